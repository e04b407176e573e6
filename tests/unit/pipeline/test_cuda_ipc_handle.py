"""A CUDA IPC pool handle travels as plain fields; nothing received is unpickled."""

from __future__ import annotations

import pickle

import msgspec
import pytest

torch = pytest.importorskip("torch")

from realtime_omni.pipeline.cuda_ipc import PoolHandle, import_handle  # noqa: E402


def test_a_handle_decodes_to_the_rebuild_arguments_of_a_uint8_pool() -> None:
    raw = msgspec.msgpack.encode(PoolHandle(4096, 1, b"\x01" * 64, 8192, 0, b"rc", 3, None, True))
    args = import_handle(raw)
    assert args[0] is torch.Tensor and args[1] == torch.Size([4096]) and args[5] == torch.uint8
    assert args[6:10] == (1, b"\x01" * 64, 8192, 0) and args[11:] == (b"rc", 3, None, True)


class Evil:
    def __reduce__(self):  # type: ignore[no-untyped-def]
        return (print, ("pwned",))


@pytest.mark.parametrize(
    "raw",
    [
        pickle.dumps(Evil()),  # what a stranger would send to run code, before
        msgspec.msgpack.encode(["not", "a", "handle"]),
        msgspec.msgpack.encode([1, 0, "str-not-bytes", 1, 0, b"", 0, None, False]),
    ],
)
def test_anything_else_is_refused_without_running_it(raw: bytes) -> None:
    with pytest.raises((msgspec.DecodeError, msgspec.ValidationError)):
        import_handle(raw)
