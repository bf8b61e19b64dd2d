"""transformers' Qwen3 (``Qwen3ForCausalLM``): Llama's layer with an RMSNorm on each query and key head (``q_norm``,
``k_norm``, over the head width, before the rotary embedding), biases as ``attention_bias`` says, and Qwen2's sliding
layers (``use_sliding_window``, ``max_window_layers``, ``layer_types``)."""

from __future__ import annotations

from typing import Any

from ..config import ModelConfig
from ..registry import register
from ..replay import _T
from .base import FieldRules
from .decoder import TransformersDecoder
from .hf_modules import causal_mask, rope
from .llama import RULES as LLAMA_RULES, qwen_layer_types

RULES = {"qwen3": FieldRules(LLAMA_RULES["qwen2"].replayed | {"attention_bias"},
                             {k: v for k, v in LLAMA_RULES["qwen2"].no_effect.items() if k != "use_mrope"})}


class Qwen3(TransformersDecoder):
    """``Qwen3ForCausalLM``."""

    arch = "hf-qwen3"
    model_types = ("qwen3",)
    rules = RULES
    defaults = {"qwen3": {"head_dim": 128, "sliding_window": 4096, "max_window_layers": 28,
                          "max_position_embeddings": 32768}}

    def design_fields(self, fields: dict[str, Any]) -> dict[str, Any]:
        bias = bool(fields.get("attention_bias", False))
        types, window = qwen_layer_types(fields)
        return dict(qkv_bias=bias, out_bias=bias, dropout=(0.0, float(fields.get("attention_dropout") or 0.0), 0.0),
                    layer_types=types, sliding_window=window)

    def check_model(self, model: ModelConfig) -> None:
        super().check_model(model)
        if model.qkv_bias != model.out_bias or model.mlp_bias:
            raise ValueError("Qwen3's attention_bias sets the q/k/v and output biases together, and its MLP has none: "
                             "expected qkv_bias == out_bias and mlp_bias False")

    def block_parameters(self, model: ModelConfig) -> list[tuple]:
        params = super().block_parameters(model)
        hd = model.head_dim                                # q_norm and k_norm are registered after o_proj
        return params[:4] + [("norm", "self_attn.q_norm", hd), ("norm", "self_attn.k_norm", hd)] + params[4:]

    def masks(self, r: Any, cached: bool) -> dict[str, Any]:
        masks = {"full_attention": causal_mask(r, None, cached)}
        if r.model.layer_types is not None:
            masks["sliding_attention"] = causal_mask(r, r.model.sliding_window, cached)
        return masks

    def project_qkv(self, r: Any, prefix: str, n1: _T, cos: _T, sin: _T, mask: _T | None) -> tuple[_T, _T, _T]:
        """``q_norm(q_proj(x).view(B, T, H, hd)).transpose(1, 2)``, the same for k; v as Llama's; q and k rotated."""
        model = r.model
        groups = model.num_heads // model.kv_heads
        hd = model.head_dim
        normed = []
        # the gradient reaches .view(B, T, heads, hd) through the norm from the transposed rotary: reshaping it
        # back copies it (one head excepted)
        for path, norm, heads in (("self_attn.q_proj", "self_attn.q_norm", model.num_heads),
                                  ("self_attn.k_proj", "self_attn.k_norm", model.kv_heads)):
            out = self.linear(r, n1, prefix, path)
            viewed = r.reshape_copy(out, prefix + path, heads > 1)
            r.rel(out)
            normed.append(self.norm(r, viewed, r.p(prefix + norm + ".weight"), prefix + norm, width=hd))
            r.rel(viewed)
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

        return transformers.Qwen3Config(
            num_hidden_layers=model.num_layers, hidden_size=model.d_model, num_attention_heads=model.num_heads,
            num_key_value_heads=model.kv_heads, intermediate_size=model.ffn, vocab_size=model.vocab_size,
            head_dim=model.head_dim, max_position_embeddings=model.max_seq_len, tie_word_embeddings=model.tied_embeddings,
            use_cache=model.use_cache, attention_bias=model.qkv_bias, attention_dropout=model.dropout[1],
            use_sliding_window=model.layer_types is not None, sliding_window=model.sliding_window,
            layer_types=model.layer_types)


register(Qwen3())
