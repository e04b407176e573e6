"""torch <-> numpy for payloads, and the per-stage torch setup every executor does.

What the model stages hand each other (embeddings, hidden states) they emit as tensors on their
device: between GPUs of one machine the runtime moves them through CUDA IPC, elsewhere it sends
their values as numpy. So an input array is numpy (bfloat16 as `ml_dtypes.bfloat16`, which torch
cannot read directly: `pipeline/cuda_ipc.py` reinterprets the bits through int16) or a tensor (a
view of a CUDA IPC slot, or a tensor of a stage in this process); either way it is borrowed, and
`to_torch` copies it into a tensor the executor owns. `to_numpy` copies to host memory, for what
goes to the client.
"""

from __future__ import annotations

import os
from typing import Any, TypeGuard, TypeVar

import numpy as np
import torch
from torch.utils import _pytree as pytree

from realtime_omni.pipeline import cuda_ipc

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def torch_dtype(name: str) -> torch.dtype:
    try:
        return _DTYPES[name]
    except KeyError:
        raise ValueError(f"dtype {name!r}: use one of {sorted(_DTYPES)}") from None


def to_numpy(t: torch.Tensor) -> np.ndarray:
    """A host copy of `t` (bfloat16 as ml_dtypes.bfloat16)."""
    return np.array(cuda_ipc.to_numpy(t), copy=True)


def to_torch(a: np.ndarray | torch.Tensor, device: str | torch.device = "cpu") -> torch.Tensor:
    """A tensor on `device` that owns a copy of `a` (safe to keep after the call that lent `a`)."""
    if isinstance(a, torch.Tensor):
        return a.to(device, copy=True)
    return cuda_ipc.from_numpy(np.array(a, copy=True), device)


T = TypeVar("T")


def each(items: list[T | None]) -> list[T]:
    """`items`, every one of which is set (a request's decoding state, once it is prefilled)."""
    out = [i for i in items if i is not None]
    assert len(out) == len(items), "a request without its decoding state"
    return out


def nonempty(a: Any) -> TypeGuard[np.ndarray | torch.Tensor]:
    """Whether `a` is an input array (numpy or a tensor) with at least one element."""
    if isinstance(a, torch.Tensor):
        return a.numel() > 0
    return isinstance(a, np.ndarray) and a.size > 0


# oneDNN builds a kernel for each convolution and each new input shape and keeps the last 1,024
# by default. The tiny code2wav alone has 34 convolutions and its steps come in every batch
# shape (rows x frames), so it kept rebuilding them: chunks of 32 shapes, decoded a second time,
# 1.73 s with 1,024 kept and 1.11 s with this many (benchmarks/vocoder_shapes.py, medians of 3
# rounds), at no cost in memory that showed (peak RSS 744 and 706 MB, one run each). Read once,
# at a process's first oneDNN call.
ONEDNN_KERNELS = 16384


def setup_torch(device: str) -> torch.device:
    """No autograd, as many intra-op threads as the stage's `threads` (the worker exports it
    as OMP_NUM_THREADS before the executor is built), and oneDNN's kernels kept (unless the
    environment says otherwise)."""
    os.environ.setdefault("ONEDNN_PRIMITIVE_CACHE_CAPACITY", str(ONEDNN_KERNELS))
    torch.set_grad_enabled(False)
    threads = int(os.environ.get("OMP_NUM_THREADS", "1") or 1)
    torch.set_num_threads(max(1, threads))
    return torch.device(device)


def model_dtype(ctx_model: dict[str, Any], device: str) -> torch.dtype:
    """`model.dtype` of the config; default bfloat16 on CUDA and float32 on the CPU."""
    name = ctx_model.get("dtype") or ("bfloat16" if device.startswith("cuda") else "float32")
    return torch_dtype(str(name))


def tensors_in(x: Any) -> list[torch.Tensor]:
    """The tensors in nested tuples, lists and dicts (an op's arguments, a kept session's)."""
    return [t for t in pytree.tree_leaves(x) if isinstance(t, torch.Tensor)]
