"""transformers' OLMoE (``OlmoeForCausalLM``): q and k each normed over their whole width before the heads are
split, then Llama's attention, and the sparse MoE block of ``moe.py`` in every layer (the router's weights
renormalised with ``norm_topk_prob``)."""

from __future__ import annotations

from typing import Any

from ..config import ModelConfig
from ..registry import register
from ..replay import _T
from .decoder import TransformersDecoder
from .hf_modules import rope
from .moe import RULES, MoEDecoder, common_config


class Olmoe(MoEDecoder):
    """``OlmoeForCausalLM``: q and k each normed over their whole width (before the heads are split), then Llama's
    attention; the router's weights renormalised with ``norm_topk_prob``."""

    arch = "hf-olmoe"
    model_types = ("olmoe",)
    rules = {"olmoe": RULES["olmoe"]}
    defaults = {"olmoe": {"max_position_embeddings": 4096}}
    needed = TransformersDecoder.needed

    def design_fields(self, fields: dict[str, Any]) -> dict[str, Any]:
        bias = bool(fields.get("attention_bias", False))
        return dict(qkv_bias=bias, out_bias=bias, dropout=(0.0, float(fields.get("attention_dropout") or 0.0), 0.0),
                    extra=tuple(self.moe_fields(fields).items()))

    def check_model(self, model: ModelConfig) -> None:
        super().check_model(model)
        if model.head_dim * model.num_heads != model.d_model or model.sliding_window is not None:
            raise ValueError("OLMoE's heads tile the width and no layer slides: expected head_width None and "
                             "sliding_window None")

    def attention_parameters(self, model: ModelConfig) -> list[tuple]:
        q, kv = model.num_heads * model.head_dim, model.kv_heads * model.head_dim
        return [*TransformersDecoder.block_parameters(self, model)[:4], ("norm", "self_attn.q_norm", q),
                ("norm", "self_attn.k_norm", kv)]

    def project_qkv(self, r: Any, prefix: str, n1: _T, cos: _T, sin: _T, mask: _T | None) -> tuple[_T, _T, _T]:
        """``q_norm(q_proj(x))``, ``k_norm(k_proj(x))`` over the whole width, then ``.view(B, T, heads, hd)
        .transpose(1, 2)``; v as Llama's; q and k rotated."""
        model = r.model
        groups = model.num_heads // model.kv_heads
        normed = []
        for path, norm, heads in (("self_attn.q_proj", "self_attn.q_norm", model.num_heads),
                                  ("self_attn.k_proj", "self_attn.k_norm", model.kv_heads)):
            out = self.linear(r, n1, prefix, path)
            n = self.norm(r, out, r.p(prefix + norm + ".weight"), prefix + norm, width=heads * model.head_dim)
            r.rel(out)
            normed.append(r.reshape_copy(n, prefix + path, heads > 1))
            r.rel(n)
        repeated_v = (model.attention == "eager" or (groups > 1 and mask is not None)
                      or (model.dropout[1] > 0 and r.device == "cpu"))
        out = self.linear(r, n1, prefix, "self_attn.v_proj")
        v = r.reshape_copy(out, prefix + "self_attn.v_proj", repeated_v and model.kv_heads > 1)
        r.rel(out)
        q, k = normed
        q_rot = rope(r, q, cos, sin, prefix + "query")
        k_rot = rope(r, k, cos, sin, prefix + "key")
        r.rel(q, k)
        return q_rot, k_rot, v

    def transformers_config(self, model: ModelConfig) -> Any:
        import transformers

        return transformers.OlmoeConfig(**common_config(model), num_experts=model.setting("experts"),
                                        norm_topk_prob=model.setting("normalize"), attention_bias=model.qkv_bias)


register(Olmoe())
