"""A spoken answer that turns into a function call ends its speech as a stop token would.

The thinker stops speaking at `<tool_call>`; the talker must still get that token marked `last`,
so it feeds its end-of-text row (`tts_eos`) once, as `generate` does when the text ends, instead
of conditioning on `tts_pad` after text that never ended (with real weights, speech that can run
to `max_frames`). The tiny model's greedy text is arbitrary, so one of its own tokens stands in
for `<tool_call>` (`params.tool_call_token_id`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from tests.models.conftest import tiny_config
from tests.models.inproc import InProcess
from tests.models.reference import conversation

GREEDY = {"temperature": 0, "talker_temperature": 0, "max_tokens": 10, "talker_max_tokens": 30}
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city.",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
    },
}


def end_of_text_rows(p: InProcess) -> list[bool]:
    """Per talker step input, whether it was a text's last token (its end-of-text row)."""
    talker = p.stages["talker_ar"].executor
    rows: list[bool] = []
    step_inputs = talker._step_inputs

    def spy(reqs: list[Any], toks: list[Any]) -> Any:
        rows.extend(t is not None and t.last for t in toks)
        return step_inputs(reqs, toks)

    talker._step_inputs = spy
    return rows


def test_a_spoken_answer_that_turns_into_a_tool_call_gets_one_end_of_text_row(
    tiny_dir: Path,
) -> None:
    payload = {**conversation("text"), **GREEDY, "tools": [WEATHER]}
    plain = InProcess(tiny_config(thinker={"tool_call_token_id": -1}))  # no token is a call
    rows = end_of_text_rows(plain)
    plain.submit("plain", payload)
    plain.run()
    ids = [o["token_id"] for o in plain.outputs["plain"]["decode"]]
    assert sum(rows) == 1  # the answer's own end (max_tokens): one end-of-text row
    k = next(i for i in range(3, len(ids) - 1) if ids[i] not in ids[:i])
    call = InProcess(tiny_config(thinker={"tool_call_token_id": ids[k]}))
    rows = end_of_text_rows(call)
    call.submit("call", payload)
    call.run()
    text = call.outputs["call"]["decode"]
    assert [o["token_id"] for o in text] == ids  # the text goes on, the call written out
    assert sum(rows) == 1, "the talker never ended the speech at the call"
    # Frames were made for tokens 0..k-1 and the end-of-text row, then padding: the speech
    # is cut where the call began (the tiny talker never says codec EOS: it runs to its limit).
    assert len(call.outputs["call"]["code2wav"]) > 0
