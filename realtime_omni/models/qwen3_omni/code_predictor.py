"""The talker's code predictor, 15 steps for a whole batch in one fixed-shape walk.

Per frame, the code predictor runs a 2-position prefill (the talker's last hidden state and code
0) and 14 one-position steps, each giving the next residual code. Through
`Qwen3OmniMoeTalkerCodePredictorModelForConditionalGeneration.forward` every step pays for the
model's wrappers, a causal-mask build, the rotary embedding of its position, a `DynamicCache`
update that concatenates, and the layers' own wrappers: with the tiny model that was most of a
talker step (34 ms for one request on a CPU, 87 % of it in the 15 steps).

`CodePredictorLoop` runs the same modules in the same order on the same values, without them:
the positions are always 0..15, so their rotary tables are made once; the cache is two
preallocated [n, kv heads, 16, head dim] buffers per layer, written in place; the attention is
the configured implementation's function, called as the attention module calls it (no mask:
causal for the prefill, everything so far for a step). `tests/models` hold it to `generate`'s
codes exactly (greedy) and to the transformers forward's logits.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
from transformers.models.qwen3_omni_moe import modeling_qwen3_omni_moe as qo


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
        self.cos, self.sin = self.model.rotary_emb(w[:1, None], pos)  # [1, 16, head dim]

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
        for layer, (keys, values) in zip(self.model.layers, kv, strict=True):
            a = layer.self_attn
            h = layer.input_layernorm(x)
            heads = (n, t, -1, a.head_dim)
            q = a.q_norm(a.q_proj(h).view(heads)).transpose(1, 2)
            k = a.k_norm(a.k_proj(h).view(heads)).transpose(1, 2)
            v = a.v_proj(h).view(heads).transpose(1, 2)
            q, k = qo.apply_rotary_pos_emb(q, k, cos, sin)
            keys[:, :, start:end] = k
            values[:, :, start:end] = v
            o, _ = self.attention(
                a, q, keys[:, :, :end], values[:, :, :end], None, dropout=0.0,
                scaling=a.scaling, sliding_window=None,
            )  # fmt: skip
            x = x + a.o_proj(o.reshape(n, t, -1).contiguous())
            x = x + layer.mlp(layer.post_attention_layernorm(x))
        return self.model.norm(x)
