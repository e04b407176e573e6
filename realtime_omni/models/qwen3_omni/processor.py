"""The Qwen3-Omni processor without a video processor, loaded from a checkpoint directory.

The published `Qwen3OmniMoeProcessor` requires a video processor, whose only implementation
needs torchvision (not a dependency here), and `ProcessorMixin` type-checks every sub-processor.
`load_processor` builds it with `video_processor=None` and the Pillow image processor; audio
features come from `WhisperFeatureExtractor` (numpy only). Video input is not supported.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def load_processor(d: Path) -> Any:
    from transformers import AutoTokenizer, Qwen3OmniMoeProcessor, WhisperFeatureExtractor
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import (
        Qwen2VLImageProcessorPil,
    )

    class _NoVideoProcessor(Qwen3OmniMoeProcessor):
        def check_argument_for_proper_class(self, argument_name: str, argument: Any) -> Any:
            if argument is None and argument_name == "video_processor":
                return None
            return super().check_argument_for_proper_class(argument_name, argument)

    tokenizer = AutoTokenizer.from_pretrained(d)
    return _NoVideoProcessor(
        image_processor=Qwen2VLImageProcessorPil.from_pretrained(d),
        video_processor=None,
        feature_extractor=WhisperFeatureExtractor.from_pretrained(d),
        tokenizer=tokenizer,
        chat_template=chat_template(d) or tokenizer.chat_template,
    )


def chat_template(d: Path) -> str | None:
    """The chat template a checkpoint ships: `chat_template.jinja`, else the `chat_template`
    of `chat_template.json` (the published Qwen3-Omni checkpoints ship that one), else None
    (the tokenizer's own then)."""
    jinja, js = d / "chat_template.jinja", d / "chat_template.json"
    if jinja.is_file():
        return jinja.read_text()
    if js.is_file():
        value = json.loads(js.read_text()).get("chat_template")
        return str(value) if value else None
    return None
