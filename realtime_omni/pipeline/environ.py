"""The environment a stage process starts with: the server's, less its credentials.

A stage needs the paths, the thread and device settings, and the deployment's CurveZMQ key where
its edges go over TCP; it needs none of the gateway's API keys, phone providers' auth tokens or
SIP passwords, which would otherwise sit in every stage's `/proc/<pid>/environ` (the fork server's
too: a forked child's initial environment is its parent's). Every variable whose name reads as a
credential is left out, except those the caller keeps.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping

CREDENTIAL = re.compile(r"KEY|TOKEN|SECRET|PASSW(OR)?D|_PASS$|CREDENTIAL|AUTH|COOKIE", re.I)


def stage_environ(environ: Mapping[str, str], keep: Iterable[str] = ()) -> dict[str, str]:
    """`environ` without the variables that name a credential, but those in `keep`."""
    kept = set(keep)
    return {k: v for k, v in environ.items() if k in kept or not CREDENTIAL.search(k)}
