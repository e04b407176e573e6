"""The preprocessing stage: a conversation -> prompt ids, 128-bin mel features, image patches.

Request payload (from the caller):
- `messages`: a list of `{role, content}` with role `system`, `user` or `assistant` and content a
  string or a list of parts `{type: text, text}`, `{type: audio, audio: NAME}`,
  `{type: image, image: NAME}`, where NAME is a top-level key of the payload holding the array:
  audio as 16 kHz mono float32 [n], an image as uint8 [H, W, 3];
- optional sampling fields passed on unchanged: `temperature`, `top_p`, `top_k`, `seed`,
  `max_tokens` (thinker), `speaker` and `talker_*` (talker); `session_id` (thinker and
  talker: the conversation whose KV caches the turn may continue); `prefill_only` (thinker.py:
  prefill the conversation for its session and answer nothing). A prefill-only request leaves
  out the images of its last message that follow the message's last audio: the audio still
  grows, so nothing after it can be reused, and encoding them would be wasted.

Outputs (to the stages present downstream): thinker `input_ids`, `image_grid_thw`,
`audio_lengths` and the thinker fields; audio_encoder `mel` [128, T] float32 (every audio's
valid frames, concatenated) and `audio_lengths`; image_encoder `pixel_values` [P, C] float32
and `image_grid_thw`; talker_ar the ids, grid, lengths, speaker and talker fields.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from realtime_omni.errors import ExecutorError
from realtime_omni.models.qwen3_omni.processor import load_processor
from realtime_omni.models.qwen3_omni.weights import model_dir
from realtime_omni.pipeline.executor import Emit, StageContext

Payload = dict[str, Any]
THINKER_FIELDS = (
    "temperature", "top_p", "top_k", "seed", "max_tokens", "session_id", "text_only",
    "prefill_only",
)  # fmt: skip


class PreprocessingExecutor:
    def __init__(self, ctx: StageContext) -> None:
        self.processor = load_processor(model_dir(ctx.model))
        self.downstream = ctx.downstream
        self.todo: dict[str, Payload] = {}  # one input each, done in the next step

    def add_request(self, request_id: str, inputs: dict[str, Payload]) -> None:
        (payload,) = inputs.values()
        try:  # the processor copies what it keeps out of the borrowed arrays
            self.todo[request_id] = self._prepare(payload)
        except (KeyError, TypeError, ValueError) as e:
            del self.todo[request_id]
            raise ExecutorError(request_id, f"preprocessing: bad request: {e}") from None

    def add_item(self, request_id: str, src: str, item: Payload) -> None:
        raise ExecutorError(request_id, "preprocessing takes no streamed input")

    def end_stream(self, request_id: str, src: str) -> None:
        pass

    def has_work(self) -> bool:
        return bool(self.todo)

    def step(self) -> list[Emit]:
        emits: list[Emit] = []
        for rid, out in self.todo.items():
            for target, data in out.items():
                if target in self.downstream:
                    emits.append(Emit(rid, data, to=target))
            emits.append(Emit(rid, done=True))
        self.todo.clear()
        return emits

    def abort(self, request_id: str) -> None:
        self.todo.pop(request_id, None)

    def _prepare(self, payload: Payload) -> dict[str, Payload]:
        if payload.get("prefill_only"):
            payload = {**payload, "messages": _without_trailing_images(payload["messages"])}
        enc, audios, images = encode_conversation(self.processor, payload, "np")
        ids = np.asarray(enc["input_ids"][0], dtype=np.int64)
        shared: Payload = {"input_ids": ids}
        audio: Payload = {"n": len(audios)}
        image: Payload = {"n": len(images)}
        if audios:
            mask = np.asarray(enc["feature_attention_mask"]).astype(bool)
            feats = np.asarray(enc["input_features"], dtype=np.float32)  # [n, 128, T]
            lengths = mask.sum(-1).astype(np.int64)
            shared["audio_lengths"] = lengths
            audio["mel"] = np.concatenate([f[:, m] for f, m in zip(feats, mask, strict=True)], 1)
            audio["audio_lengths"] = lengths
        if images:
            grid = np.asarray(enc["image_grid_thw"], dtype=np.int64)
            shared["image_grid_thw"] = grid
            image["pixel_values"] = np.asarray(enc["pixel_values"], dtype=np.float32)
            image["image_grid_thw"] = grid
        thinker = {**shared, **{k: payload[k] for k in THINKER_FIELDS if k in payload}}
        if payload.get("tools"):
            thinker["tool_calls"] = True  # <tool_call> then means a call, not words
        talker = dict(shared)
        talker.update(
            {
                k: v
                for k, v in payload.items()
                if k in ("speaker", "session_id", "text_only") or k.startswith("talker_")
            }
        )
        return {
            "thinker": thinker,
            "talker_ar": talker,
            "audio_encoder": audio,
            "image_encoder": image,
        }


def _without_trailing_images(messages: list[Payload]) -> list[Payload]:
    """`messages` with the images of the last message that come after its last audio left out."""
    if not messages or isinstance(messages[-1]["content"], str):
        return messages
    parts = messages[-1]["content"]
    audio = [i for i, p in enumerate(parts) if p["type"] == "audio"]
    if not audio:
        return messages
    kept = [p for i, p in enumerate(parts) if i <= audio[-1] or p["type"] != "image"]
    return [*messages[:-1], {**messages[-1], "content": kept}]


def encode_conversation(
    processor: Any, payload: Payload, return_tensors: str
) -> tuple[Any, list[np.ndarray], list[np.ndarray]]:
    """A request's `messages` through the chat template and the processor (ids, mel, patches);
    gives the encoding and the audios and images it used, in prompt order."""
    messages = payload["messages"]
    audios: list[np.ndarray] = []
    images: list[np.ndarray] = []
    for msg in messages:
        content = msg["content"]
        for part in [] if isinstance(content, str) else content:
            if part["type"] == "audio":
                audios.append(np.asarray(payload[part["audio"]], dtype=np.float32))
            elif part["type"] == "image":
                images.append(np.asarray(payload[part["image"]], dtype=np.uint8))
            elif part["type"] != "text":
                raise ValueError(f"content type {part['type']!r} (use text, audio, image)")
    if payload.get("tool_instruction"):  # how the session's tool_choice asks to use them
        note = str(payload["tool_instruction"])
        if messages and messages[0]["role"] == "system" and isinstance(messages[0]["content"], str):
            messages = [
                {**messages[0], "content": f"{messages[0]['content']}\n\n{note}"},
                *messages[1:],
            ]
        else:
            messages = [{"role": "system", "content": note}, *messages]
    # The checkpoint's own template renders `tools` (Qwen3's <tools> block in the system turn),
    # an assistant turn's `tool_calls` and the `tool` turns that answer them.
    text = processor.apply_chat_template(
        messages, tools=payload.get("tools") or None, tokenize=False, add_generation_prompt=True
    )
    kw: dict[str, Any] = {}
    if audios:
        kw["audio"] = audios
    if images:
        kw["images"] = images
    return processor(text=text, return_tensors=return_tensors, **kw), audios, images
