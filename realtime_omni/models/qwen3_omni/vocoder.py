"""code2wav's convolutions, streamed: each chunk decodes only its new frames.

`Qwen3OmniMoeCode2Wav.forward` runs the pre-transformer and then a stack of causal
convolutions (upsampling, ConvNeXt blocks, the decoder's residual units) over the frames it is
given. Decoding a chunk with frames of left context, as `chunked_decode` does, runs the whole
stack again over the context: with 25 frames of context, a 10-frame chunk costs 35 frames of
convolutions, and the convolutions are nearly all of code2wav's time on a CPU (tiny model, 16 x
35 frames: pre-transformer 4 ms, convolutions 960 ms).

The convolutions see only a few frames back, so they stream exactly: `StreamingDecoder` keeps,
per request, what each causal convolution needs of its past input (the last `padding` samples,
which the module would otherwise pad with zeros) and what each transposed convolution needs
(its last input sample: its output reaches one input ahead, which is why one call cuts 555
samples at its end). With that state, the decoder on frames [s, e) gives exactly the samples one
call on all frames gives for them, and a chunk's output follows its predecessor's with nothing
dropped or repeated: the first chunk returns n * 1920 - 555 samples, every later one n * 1920.

The pre-transformer stays a window (its sliding-window attention reaches `layers x window`
frames back: the executor gives it `left_context_frames` of them). The walk below uses the
transformers modules' own parameters and sub-modules and reproduces their forward exactly;
`tests/models/test_stream_pieces.py` holds it to one call of the real model.
"""

from __future__ import annotations

import torch
from torch import nn
from transformers.models.qwen3_omni_moe import modeling_qwen3_omni_moe as qo

State = dict[nn.Module, torch.Tensor]  # per request: batch dimension 1
NATIVE_TRANSPOSED = True  # see `_native`; benchmarks/vocoder_shapes.py compares both


class StreamingDecoder:
    def __init__(self, model: qo.Qwen3OmniMoeCode2Wav) -> None:
        self.model = model
        for m in model.modules():
            if isinstance(m, qo.Qwen3OmniMoeCausalConvNet) and m.stride != 1:
                raise ValueError("code2wav streaming: a strided causal convolution")
            if isinstance(m, qo.Qwen3OmniMoeCausalTransConvNet):
                k, s = m.conv.kernel_size[0], m.conv.stride[0]
                if k not in (s, 2 * s):
                    raise ValueError(f"code2wav streaming: transposed convolution {k}/{s}")

    def hidden(self, codes: torch.Tensor) -> torch.Tensor:
        """codes [B, 16, T] -> the pre-transformer's output [B, T, hidden]."""
        m = self.model
        x = m.code_embedding(codes + m.code_offset).mean(1)
        return m.pre_transformer(inputs_embeds=x).last_hidden_state

    def decode(
        self, hidden: torch.Tensor, states: list[State], frames: list[int] | None = None
    ) -> torch.Tensor:
        """The new frames' hidden states [B, T, hidden] -> their samples [B, n]; `states` (one
        per row, all empty or all from earlier chunks) are updated in place. With `frames`,
        row i holds only its first `frames[i]` frames and padding after them (later chunks of
        several lengths in one call): every layer is causal, so its first `frames[i]` frames'
        worth of samples are those of a call on its frames alone, and its state is taken
        where its frames end; the samples after them are padding too."""
        ends = None
        if frames is not None and min(frames) < hidden.shape[1]:
            ends = torch.tensor(frames, device=hidden.device)
        walk = _Walk(_stack(states), ends)
        x = hidden.permute(0, 2, 1)
        for blocks in self.model.upsample:
            assert isinstance(blocks, nn.ModuleList)  # a transposed convolution, a ConvNeXt block
            for block in blocks:
                x = walk.run(block, x)
        for block in self.model.decoder:
            x = walk.run(block, x)
        for i, s in enumerate(states):
            s.update({k: v[i : i + 1] for k, v in walk.state.items()})
        return x[:, 0].clamp(min=-1, max=1)


class _Walk:
    """One `decode` through the layers: the stacked state, and where each row's samples end
    at the current rate (None: every row is whole)."""

    def __init__(self, state: State, ends: torch.Tensor | None) -> None:
        self.state, self.ends = state, ends

    def _tail(self, x: torch.Tensor, n: int, shift: int = 0) -> torch.Tensor:
        """Each row's last n samples of x [B, C, L], its end `shift` samples on."""
        if self.ends is None:
            return x[..., -n:]
        at = self.ends[:, None] + shift - n + torch.arange(n, device=x.device)
        return x.gather(2, at[:, None, :].expand(-1, x.shape[1], -1))

    def run(self, m: nn.Module, x: torch.Tensor) -> torch.Tensor:
        state = self.state
        if isinstance(m, qo.Qwen3OmniMoeCausalConvNet):
            if m.padding == 0:
                return m.conv(x)
            past = state.get(m)
            if past is None:
                past = x.new_zeros(x.shape[0], x.shape[1], m.padding)
            x = torch.cat([past, x], dim=-1)
            state[m] = self._tail(x, m.padding, m.padding)
            return m.conv(x)
        if isinstance(m, qo.Qwen3OmniMoeCausalTransConvNet):
            past = state.get(m) if m.left_pad else None
            if m.left_pad:
                state[m] = self._tail(x, 1)
            if self.ends is not None:
                self.ends = self.ends * m.conv.stride[0]
            return _native(m, x if past is None else torch.cat([past, x], dim=-1))
        if isinstance(m, qo.Qwen3OmniMoeConvNeXtBlock):
            h = self.run(m.dwconv, x).permute(0, 2, 1)
            h = m.gamma * m.pwconv2(m.act(m.pwconv1(m.norm(h))))
            return x + h.permute(0, 2, 1)
        if isinstance(m, qo.Qwen3OmniMoeCode2WavDecoderResidualUnit):
            h = self.run(m.conv1, self.run(m.act1, x))
            return x + self.run(m.conv2, self.run(m.act2, h))
        if isinstance(m, qo.Qwen3OmniMoeCode2WavDecoderBlock):
            for b in m.block:
                x = self.run(b, x)
            return x
        if isinstance(m, qo.Qwen3OmniMoeSnakeBeta):
            return _snake(m, x)
        raise TypeError(f"code2wav streaming: no rule for {type(m).__name__}")


def _native(m: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """`m(x)` with PyTorch's own CPU kernels instead of oneDNN's: for the transposed
    convolutions they are faster, whether oneDNN has its kernel for the shape yet or must build
    it (code2wav's steps come in every batch shape). Chunks of 32 shapes, tiny model: 1.89 ->
    1.58 s the first time, 1.11 -> 1.06 s with every kernel built (benchmarks/vocoder_shapes.py).
    The other convolutions stay with oneDNN: PyTorch's kernels took 1.5x as long for them."""
    if not NATIVE_TRANSPOSED or x.device.type != "cpu" or not torch.backends.mkldnn.enabled:
        return m(x)
    # The flag is a descriptor on torch's module object, which mypy reads as the descriptor.
    torch.backends.mkldnn.enabled = False  # type: ignore[assignment]
    try:
        return m(x)
    finally:
        torch.backends.mkldnn.enabled = True  # type: ignore[assignment]


def _stack(states: list[State]) -> State:
    if not states[0]:
        if any(states):
            raise ValueError("code2wav streaming: first and later chunks in one batch")
        return {}
    return {k: torch.cat([s[k] for s in states]) for k in states[0]}


def _snake(m: qo.Qwen3OmniMoeSnakeBeta, x: torch.Tensor) -> torch.Tensor:
    """`SnakeBeta.forward`, x + sin(x * alpha)^2 / (beta + eps), in one buffer: the same ops
    in the same order (`square_` is `pow(2)`), so the same values to the bit. The module makes
    a tensor of x's size for each of its five ops, and on a CPU those allocations, each a fresh
    mapping of memory for the samples of a batch, cost four times the arithmetic (tiny model,
    16 x 4 x 19,200 samples: 21-26 ms through the module, 5-6 ms here)."""
    alpha = torch.exp(m.alpha.unsqueeze(0).unsqueeze(-1))
    inv_beta = 1.0 / (torch.exp(m.beta.unsqueeze(0).unsqueeze(-1)) + m.no_div_by_zero)
    y = x * alpha
    return y.sin_().square_().mul_(inv_beta).add_(x)
