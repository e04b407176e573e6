"""One exception root, `OmniError`. A `RequestError` fails one request and the others go on; a
`StageDied` (a sibling, not a kind of `RequestError`) is fatal to every request that was on the
dead stage; a `ConfigError` stops the server at load. Where either ends the one request in hand,
catch both: `except (RequestError, StageDied)`."""

from __future__ import annotations


class OmniError(Exception):
    """Root of every error the runtime raises on purpose."""


class ConfigError(OmniError):
    """The pipeline config is invalid. The message names the field, the value and the fix."""


class RequestError(OmniError):
    """One request failed (bad input, an executor error); the pipeline and other requests live."""


class StageDied(OmniError):
    """The process of a stage died while the request still needed it: every request on it
    fails, and the stage is restarted (a warm spare takes over, where there is one)."""


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
