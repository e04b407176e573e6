"""The thinker's text split into words and function calls, however decode's deltas cut it."""

from __future__ import annotations

import pytest

from realtime_omni.gateway.protocol.tool_calls import Call, ToolCallStream

CALL = '{"name": "get_weather", "arguments": {"city": "Paris"}}'
TEXT = f"Let me check.<tool_call>\n{CALL}\n</tool_call>"


def split(text: str, size: int) -> list[str | Call]:
    s, out = ToolCallStream(), []
    for i in range(0, len(text), size):
        out += s.push(text[i : i + size])
    return out + s.flush()


@pytest.mark.parametrize("size", [1, 2, 5, 11, 1000])
def test_a_call_is_cut_out_of_the_words_wherever_the_deltas_split_its_tags(size: int) -> None:
    got = split(TEXT + " Done.", size)
    words = "".join(p for p in got if isinstance(p, str))
    calls = [p for p in got if isinstance(p, Call)]
    assert words == "Let me check. Done."
    assert calls == [Call("get_weather", '{"city": "Paris"}')]


def test_text_like_a_tag_that_is_not_one_is_said_and_an_unclosed_call_is_taken_whole() -> None:
    assert "".join(str(p) for p in split("a <tool and <b>", 3)) == "a <tool and <b>"
    got = split('<tool_call>{"name": "f", "arguments": "{}"}', 4)  # stopped before the close
    assert got == [Call("f", "{}")]


def test_a_call_that_does_not_parse_is_dropped_and_kept_for_the_log() -> None:
    s = ToolCallStream()
    assert s.push("<tool_call>{not json}</tool_call>ok") == ["ok"]
    assert s.malformed == ["{not json}"]
    assert split('<tool_call>{"arguments": {}}</tool_call>', 100) == []  # no name
