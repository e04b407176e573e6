"""Server events checked against the installed `openai` SDK's pydantic types, GA and beta: what a
validating client (the Agents SDK, Pipecat) parses every event with.

    problems = check(event, beta=False)   # [] when the SDK's type for event["type"] takes it
"""

from __future__ import annotations

import json
import typing
from functools import cache
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ValidationError


@cache
def _models(beta: bool) -> dict[str, type[BaseModel]]:
    if beta:
        from openai.types.beta.realtime import RealtimeServerEvent
    else:
        from openai.types.realtime import RealtimeServerEvent
    union = typing.get_args(RealtimeServerEvent)[0]  # Annotated[Union[...], PropertyInfo]
    out = {}
    for model in typing.get_args(union):
        (kind,) = typing.get_args(model.model_fields["type"].annotation)
        out[kind] = model
    return out


@cache
def _live() -> Any:
    from openai.types.live import ServerEvent
    from pydantic import TypeAdapter

    return TypeAdapter(ServerEvent)


def check_live(event: dict[str, Any]) -> list[str]:
    """What the SDK's Live API server event types refuse in this event."""
    try:
        _live().validate_python(event)
    except ValidationError as e:
        return [f"{'.'.join(map(str, err['loc']))}: {err['msg']}" for err in e.errors()][:3]
    return []


def check(event: dict[str, Any], beta: bool = False) -> list[str]:
    """What the SDK's type for this event refuses in it (an unknown type is a problem too)."""
    model = _models(beta).get(str(event.get("type")))
    if model is None:
        return [f"{event.get('type')!r} is no {'beta' if beta else 'GA'} server event"]
    try:
        model.model_validate(event)
    except ValidationError as e:
        return [f"{'.'.join(map(str, err['loc']))}: {err['msg']}" for err in e.errors()]
    return []


def check_log(path: Path) -> dict[str, list[str]]:
    """Every event of a `serve --event-log` file: `{"type (GA|beta)": [problems]}`, one entry
    per event type that failed (its first failure)."""
    bad: dict[str, list[str]] = {}
    if not path.exists():
        return bad
    for line in path.read_text().splitlines():
        rec = json.loads(line)
        ev, beta = rec["event"], rec["beta"]
        if rec["transport"] == "live":  # OpenAI's Live API: its own types
            key = f"{ev.get('type')} (live)"
            if key not in bad and (problems := check_live(ev)):
                bad[key] = problems
            continue
        key = f"{ev.get('type')} ({'beta' if beta else 'GA'})"
        if key not in bad and (problems := check(ev, beta)):
            bad[key] = problems
    return bad
