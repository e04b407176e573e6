"""Every control message survives encode/decode unchanged, and a socket gives them back whole."""

from __future__ import annotations

import msgspec
import pytest
import zmq

from realtime_omni.pipeline import messages as m

SAMPLES: list[m.Message] = [
    m.DataReady(
        request_id="r1",
        src="thinker",
        dst="talker_ar",
        src_process="gpu0#0",
        lease=3,
        meta={"text": "hi", "n": 2, "ok": True, "raw": b"\x00\xff", "nested": {"a": [1, 2.5]}},
        arrays=[
            m.ArrayRef("hidden", "bfloat16", (1, 2048), -1, 128, 4096),
            m.ArrayRef("scalar", "int64", (), 1, 0, 8),
        ],
        route={"gpu0": 0, "cpu": 1},
        transport="shm",
        segment="rto_1_gpu0-0_0_thinker_talker_ar",
        handle=b"\x01\x02",
    ),
    m.DataReady(
        request_id="r2",
        src="client",
        dst="a",
        src_process="client",
        lease=0,
        meta={},
        arrays=[],
        route={},
        transport="inline",
    ),
    m.DataAck(src="a", dst="b", lease=7),
    m.StreamEnd(request_id="r1", src="a", dst="b", route={"b": 1}),
    m.Abort(request_id="r1"),
    m.AbortAck(request_id="r1", stage="a", process="a#0"),
    m.StageDone(request_id="r1", stage="a", process="a#1", compute_s=0.25),
    m.Spent(request_id="r1", stage="a", compute_s=0.125),
    m.StageError(request_id="r1", stage="a", message="ValueError: boom"),
    m.Ready(process="a#0", epoch=2, pid=1234),
    m.Heartbeat(process="a#0", epoch=2),
    m.PeerDown(process="b#0"),
    m.PeerUp(process="b#0", epoch=3),
    m.PeerUpAck(process="a#0", peer="b#0"),
    m.StatsRequest(token=9),
    m.Stats(
        token=9,
        process="a#0",
        free_slots={"a->b": 3},
        total_slots={"a->b": 8},
        active_requests={"a": 2},
        segments=["rto_1_a-0.0.a.b"],
        steps={"a": [(12.5, 0.015)]},
    ),
    m.Shutdown(),
]


@pytest.mark.parametrize("msg", SAMPLES, ids=lambda x: type(x).__name__)
def test_round_trip(msg: m.Message) -> None:
    frame = m.encode(msg)
    assert isinstance(frame, bytes)
    back = m.decode(frame)
    assert type(back) is type(msg)
    assert back == msg
    assert m.decode(memoryview(frame)) == msg


def test_every_message_type_is_sampled() -> None:
    tagged = {
        obj
        for obj in vars(m).values()
        if isinstance(obj, type)
        and issubclass(obj, msgspec.Struct)
        and obj not in (m.ArrayRef, m._Message)
    }
    assert tagged == {type(x) for x in SAMPLES}


def test_array_shape_decodes_as_a_tuple() -> None:
    back = m.decode(m.encode(SAMPLES[0]))
    assert isinstance(back, m.DataReady)
    assert back.arrays[0].shape == (1, 2048)
    assert isinstance(back.arrays[1].shape, tuple)


def test_garbage_does_not_decode() -> None:
    with pytest.raises(msgspec.DecodeError):
        m.decode(b"\x93\x01\x02")
    with pytest.raises(msgspec.ValidationError):
        m.decode(msgspec.msgpack.encode({"type": "NoSuchMessage"}))


@pytest.mark.parametrize("copy", [True, False])
def test_receive_takes_exactly_a_messages_frames(copy: bool) -> None:
    """Frames after frame 0 are counted from the message: the next message starts cleanly."""
    ctx = zmq.Context()
    out, inbox = ctx.socket(zmq.PAIR), ctx.socket(zmq.PAIR)
    try:
        inbox.bind("inproc://receive")
        out.connect("inproc://receive")
        refs = [m.ArrayRef("a", "uint8", (3,), 2), m.ArrayRef("b", "uint8", (2,), 1)]
        m.send(out, m.DataReady("r", "a", "b", "p#0", 0, {}, refs, {}, "inline"), [b"bb", b"aaa"])
        m.send(out, m.Heartbeat("p#0", 1))
        assert zmq.select([inbox], [], [], 5)[0]
        got = m.receive(inbox, copy)
        assert got is not None
        msg, frames = got
        assert isinstance(msg, m.DataReady)
        assert [bytes(f) for f in frames[1:]] == [b"bb", b"aaa"]
        beat = m.receive(inbox, copy)
        assert beat is not None and beat[0] == m.Heartbeat("p#0", 1) and len(beat[1]) == 1
        assert m.receive(inbox, copy) is None
    finally:
        ctx.destroy(linger=0)


@pytest.fixture
def pair():  # type: ignore[no-untyped-def]
    ctx = zmq.Context()
    pull, push = ctx.socket(zmq.PULL), ctx.socket(zmq.PUSH)
    pull.bind("inproc://malformed")
    push.connect("inproc://malformed")
    yield push, pull
    push.close(0)
    pull.close(0)
    ctx.term()


def wait_readable(sock: zmq.Socket) -> None:
    assert sock.poll(2000) & zmq.POLLIN


def test_a_short_forged_or_overlong_message_raises_malformed_and_the_next_one_reads(pair) -> None:  # type: ignore[no-untyped-def]
    """Before, a message announcing a frame it lacked made `receive` block for ever (the
    coordinator's event loop with it); now every bad message is dropped whole."""
    push, pull = pair
    announces_one = SAMPLES[0]  # its second ArrayRef lives in frame 1
    good = SAMPLES[1]
    push.send(m.encode(announces_one))  # the frame it announces never comes
    push.send(b"\xc1 not msgpack")
    push.send_multipart([m.encode(good), b"extra", b"frames"])
    push.send(m.encode(good))
    for _ in range(3):
        wait_readable(pull)
        with pytest.raises(m.Malformed):
            m.receive(pull)
    wait_readable(pull)
    got = m.receive(pull)
    assert got is not None and got[0] == good and len(got[1]) == 1
    assert m.receive(pull) is None
