"""Executors for e2e tests (imported by the stage processes of a served config by module path)."""

from __future__ import annotations

import json
from typing import Any

import numpy as np

from realtime_omni.pipeline.executor import StageContext
from realtime_omni.pipeline.simulated import SimulatedExecutor


class PayloadRecorder(SimulatedExecutor):
    """A simulated entry stage that appends one JSON line per request to `params.record_to`:
    `{"request_id", "content": [part types of the last user message], "images": [{"shape",
    "mean_rgb"} of every image in the request]}`, so a test sees what a turn really carried into
    the pipeline."""

    def __init__(self, ctx: StageContext) -> None:
        super().__init__(ctx)
        self.record_to = str(ctx.params["record_to"])

    def add_request(self, request_id: str, inputs: dict[str, dict[str, Any]]) -> None:
        super().add_request(request_id, inputs)
        (payload,) = inputs.values()
        # A system or assistant message's content is a string; a user message's, a list of parts.
        lists = [m["content"] for m in payload["messages"] if isinstance(m["content"], list)]
        content = lists[-1] if lists else []
        images = [payload[p["image"]] for ps in lists for p in ps if p["type"] == "image"]
        record = {
            "request_id": request_id,
            "content": [p["type"] for p in content],
            "images": [
                {"shape": list(a.shape), "mean_rgb": np.asarray(a).mean(axis=(0, 1)).tolist()}
                for a in images
            ],
        }
        with open(self.record_to, "a") as f:
            f.write(json.dumps(record) + "\n")
