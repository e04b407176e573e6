"""The decode stage: token ids from the thinker -> text deltas for the caller.

Items in: `{token_id, index, token_time, last}`. Outputs, one per token in token order:
`{text, token_id, index, token_time}`, where `text` is what the token completes: "" for special
tokens such as `<|im_end|>` and while a multi-byte character is unfinished; but a token marked
`keep` (the thinker's `<tool_call>` and `</tool_call>` for a request with tools) comes through as
its text, for the gateway to find the calls by. The request ends with
the item marked `last` (or the end of the thinker's stream).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Any

from realtime_omni.models.qwen3_omni.detok import IncrementalDetokenizer
from realtime_omni.models.qwen3_omni.weights import model_dir
from realtime_omni.pipeline.executor import Emit, HoldsRequests, StageContext

Payload = dict[str, Any]


@dataclass
class _Request:
    detok: IncrementalDetokenizer
    items: deque[Payload] = field(default_factory=deque)  # bounded by the edge's credits
    ended: bool = False


class DecodeExecutor(HoldsRequests):
    def __init__(self, ctx: StageContext) -> None:
        from transformers import AutoTokenizer

        self.tokenizer = AutoTokenizer.from_pretrained(model_dir(ctx.model))
        self.reqs: dict[str, _Request] = {}

    def _decode(self, ids: list[int]) -> str:
        text = self.tokenizer.decode(
            ids, skip_special_tokens=True, clean_up_tokenization_spaces=False
        )
        assert isinstance(text, str)  # one sequence of ids: one string
        return text

    def add_request(self, request_id: str, inputs: dict[str, Payload]) -> None:
        self.reqs[request_id] = _Request(IncrementalDetokenizer(self._decode))

    def add_item(self, request_id: str, src: str, item: Payload) -> None:
        keys = (
            "token_id",
            "index",
            "token_time",
            "last",
            "keep",
            "prefill_tokens",
            "cached_tokens",
        )
        meta = {k: item[k] for k in keys if k in item}
        self.reqs[request_id].items.append(meta)

    def end_stream(self, request_id: str, src: str) -> None:
        self.reqs[request_id].ended = True

    def has_work(self) -> bool:
        return any(r.items or r.ended for r in self.running().values())

    def step(self) -> list[Emit]:
        emits: list[Emit] = []
        for rid, r in list(self.running().items()):
            done = r.ended
            while r.items:
                item = r.items.popleft()
                text = r.detok.push(int(item["token_id"]))
                if item.get("keep"):  # a function call's tag: the gateway cuts the call out
                    text += str(self.tokenizer.convert_ids_to_tokens(int(item["token_id"])))
                if item.get("last"):
                    text += r.detok.flush()
                    done = True
                data = {"text": text, **{k: item[k] for k in ("token_id", "index", "token_time")}}
                for k in ("prefill_tokens", "cached_tokens"):  # the first token's, if any
                    if k in item:
                        data[k] = item[k]
                emits.append(Emit(rid, data))
            if done:
                del self.reqs[rid]
                emits.append(Emit(rid, done=True))
        return emits

    def abort(self, request_id: str) -> None:
        self.reqs.pop(request_id, None)
