"""One exception root. A `RequestError` fails one request and the others go on; a `StageDied`
is fatal to the requests that were on the dead stage; a `ConfigError` stops the server at load."""

from __future__ import annotations


class OmniError(Exception):
    """Root of every error the runtime raises on purpose."""


class ConfigError(OmniError):
    """The pipeline config is invalid. The message names the field, the value and the fix."""


class RequestError(OmniError):
    """One request failed (bad input, an executor error); the pipeline and other requests live."""


class StageDied(RequestError):
    """The process of a stage died while the request still needed it."""


class RequestAborted(RequestError):
    """The request was aborted by its caller."""


class StartupError(OmniError):
    """A stage process did not come up."""


class PayloadTooLarge(RequestError):
    """A payload is larger than the edge's slot; the message names the config field to raise."""


class ExecutorError(RequestError):
    """Raised by an executor for one request; the stage fails that request only."""

    def __init__(self, request_id: str, message: str) -> None:
        super().__init__(message)
        self.request_id = request_id
