"""The talker's code predictor, 15 steps for a whole batch in one fixed-shape walk.

Per frame, the code predictor runs a 2-position prefill (the talker's last hidden state and code
0) and 14 one-position steps, each giving the next residual code. Through
`Qwen3OmniMoeTalkerCodePredictorModelForConditionalGeneration.forward` every step pays for the
model's wrappers, a causal-mask build, the rotary embedding of its position, a `DynamicCache`
update that concatenates, and the layers' own wrappers: with the tiny model that was most of a
talker step (34 ms for one request on a CPU, 87 % of it in the 15 steps).

`CodePredictorLoop` runs the same computation on the same values, without them: the positions
are always 0..15, so their rotary tables are made once; the cache is two preallocated
[n, kv heads, 16, head dim] buffers per layer, written in place; the attention is the
configured implementation's function, called as the attention module calls it (no mask: causal
for the prefill, everything so far for a step). The layers' modules are not called either, only
their weights, with the ops of their forwards in the same order: on a CPU each module call and
each op is a few microseconds of overhead around a tiny product, and a frame makes 30 layer
passes (tiny model, 16 rows: 67-70 ms a frame through the modules, 49-57 ms this way). The
rotary rotation `cat(-x2, x1) * sin` is `roll(x) * sin` with the sign folded into the table,
the same products to the bit, and q and k take their norms and the rotation side by side as
one tensor (the norms' weights a row per head: the same products again, half the ops). The q, k
and v projections are one product, their weights stacked, and so are the MLP's gate and up: each
output element is the same weight row times the same input.
`tests/models` hold it to `generate`'s codes exactly (greedy) and to the transformers forward's
logits within 1e-6 (the forward's masked attention over a growing cache rounds differently).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
from transformers.models.qwen3_omni_moe import modeling_qwen3_omni_moe as qo

# A layer's fused products: q, k and v's weight and bias, the MLP's gate and up's.
_Fused = tuple[torch.Tensor, torch.Tensor | None, torch.Tensor, torch.Tensor | None]


class CodePredictorLoop:
    def __init__(self, talker: qo.Qwen3OmniMoeTalkerForConditionalGeneration) -> None:
        self.embed0 = talker.get_input_embeddings()
        self.cp = talker.code_predictor
        self.model = self.cp.model
        cfg = self.cp.config
        if any(t != "full_attention" for t in cfg.layer_types):
            raise ValueError("code predictor: only full-attention layers are walked")
        self.groups = int(cfg.num_code_groups)
        self.kv_heads = int(cfg.num_key_value_heads)
        self.attention = ALL_ATTENTION_FUNCTIONS.get_interface(
            cfg._attn_implementation, qo.eager_attention_forward
        )
        w = self.cp.lm_head[0].weight
        pos = torch.arange(self.groups, device=w.device)[None]
        cos, sin = self.model.rotary_emb(w[:1, None], pos)  # [1, 16, head dim]
        # [1, 16, 1, head dim] for q, k [n, t, heads, head dim]; rotate_half(x) * sin, where
        # rotate_half(x) = cat(-x2, x1), is roll(x, half) * sin with the first half negated.
        half = cos.shape[-1] // 2
        sign = torch.ones(cos.shape[-1], dtype=sin.dtype, device=sin.device)
        sign[:half] = -1
        self.half = half
        self.cos, self.sin = cos[:, :, None], (sin * sign)[:, :, None]
        # q and k go through their RMSNorms and the rotation side by side, as one tensor of
        # q heads then k heads: the same products per element, half the ops. Per layer, the
        # two norms' weights a head each, and their epsilon.
        heads = (int(cfg.num_attention_heads), int(cfg.num_key_value_heads))
        self.qk_norms: list[tuple[torch.Tensor, float, tuple[int, int]]] = []
        # Per layer, the q, k and v projections as one product, and the MLP's gate and up as
        # one: each output element is the same row times the same input. The stacked copies
        # sit beside the modules' weights (which the transformers forward still uses): about
        # 100 MB in bf16 at the real code predictor's sizes (5 layers, 1,024 wide).
        self.fused: list[_Fused] = []
        for layer in self.model.layers:
            a, mlp = layer.self_attn, layer.mlp
            q_norm, k_norm = a.q_norm, a.k_norm
            if q_norm.variance_epsilon != k_norm.variance_epsilon:
                raise ValueError("code predictor: q_norm and k_norm differ in epsilon")
            w = torch.cat([q_norm.weight.expand(heads[0], -1), k_norm.weight.expand(heads[1], -1)])
            self.qk_norms.append((w, q_norm.variance_epsilon, heads))
            self.fused.append(
                (
                    torch.cat([a.q_proj.weight, a.k_proj.weight, a.v_proj.weight]),
                    _cat_biases(a.q_proj, a.k_proj, a.v_proj),
                    torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight]),
                    _cat_biases(mlp.gate_proj, mlp.up_proj),
                )
            )

    def frame(
        self,
        past_hidden: torch.Tensor,
        code0: torch.Tensor,
        pick: Callable[[torch.Tensor], torch.Tensor],
    ) -> torch.Tensor:
        """Codes [n, 16]: `code0` [n] and the 15 residual codes, each chosen by `pick` from the
        step's logits [n, vocab]; `past_hidden` [n, 1, D] is the talker's last hidden state."""
        n = code0.shape[0]
        first = self.embed0(code0.view(n, 1))
        x = torch.cat([past_hidden, first], dim=1)
        a = self.model.layers[0].self_attn
        shape = (n, self.kv_heads, self.groups, a.head_dim)
        kv = [(x.new_empty(shape), x.new_empty(shape)) for _ in range(len(self.model.layers))]
        codes = [code0.view(n)]
        codes.append(pick(self.cp.lm_head[0](self._forward(x, 0, kv)[:, -1])))
        for j in range(1, self.groups - 1):
            x = self.model.codec_embedding[j - 1](codes[-1].view(n, 1))
            codes.append(pick(self.cp.lm_head[j](self._forward(x, 1 + j, kv)[:, -1])))
        return torch.stack(codes, dim=1)

    def _forward(
        self, x: torch.Tensor, start: int, kv: list[tuple[torch.Tensor, torch.Tensor]]
    ) -> torch.Tensor:
        """The layers and the final norm over positions [start, start + T) of x [n, T, D]."""
        n, t = x.shape[:2]
        end = start + t
        cos, sin = self.cos[:, start:end], self.sin[:, start:end]
        layers = zip(self.model.layers, kv, self.qk_norms, self.fused, strict=True)
        for layer, (keys, values), (qk_weight, qk_eps, qk_heads), fused in layers:
            a, mlp = layer.self_attn, layer.mlp
            qkv_w, qkv_b, gate_up_w, gate_up_b = fused
            h = _rms_norm(x, layer.input_layernorm.weight, layer.input_layernorm.variance_epsilon)
            qkv = F.linear(h, qkv_w, qkv_b).view(n, t, -1, a.head_dim)
            qk, v = qkv.split([sum(qk_heads), qk_heads[1]], 2)
            qk = _rms_norm(qk, qk_weight, qk_eps)
            qk = qk * cos + qk.roll(self.half, -1) * sin
            q, k = qk.split(qk_heads, 2)
            keys[:, :, start:end] = k.transpose(1, 2)
            values[:, :, start:end] = v.transpose(1, 2)
            o, _ = self.attention(
                a, q.transpose(1, 2), keys[:, :, :end], values[:, :, :end], None, dropout=0.0,
                scaling=a.scaling, sliding_window=None,
            )  # fmt: skip
            x = x + F.linear(o.reshape(n, t, -1), a.o_proj.weight, a.o_proj.bias)
            post = layer.post_attention_layernorm
            h = _rms_norm(x, post.weight, post.variance_epsilon)
            gate, up = F.linear(h, gate_up_w, gate_up_b).chunk(2, -1)
            x = x + F.linear(mlp.act_fn(gate) * up, mlp.down_proj.weight, mlp.down_proj.bias)
        return _rms_norm(x, self.model.norm.weight, self.model.norm.variance_epsilon)


def _cat_biases(*linears: torch.nn.Linear) -> torch.Tensor | None:
    """The projections' biases end to end, for their weights fused; None when none has one."""
    if all(m.bias is None for m in linears):
        return None
    return torch.cat(
        [m.weight.new_zeros(m.out_features) if m.bias is None else m.bias for m in linears]
    )


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """`Qwen3OmniMoeRMSNorm.forward`'s ops (in float32 its casts return `x` itself); `weight`
    may hold a row per head. (`F.rms_norm` is a fifth faster here and equal on the shapes
    tried alone, but with it a batched request stopped matching in tests/models.)"""
    y = x.float()
    y = y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + eps)
    return weight * y.to(x.dtype)
