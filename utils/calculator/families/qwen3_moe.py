"""transformers' Qwen3-MoE (``Qwen3MoeForCausalLM``): Qwen3's attention (q/k norms per head), the sparse MoE block
of ``moe.py`` with experts ``moe_intermediate_size`` wide, dense SwiGLU layers from ``mlp_only_layers`` and
``decoder_sparse_step``, and a sliding window on every layer with ``use_sliding_window``."""

from __future__ import annotations

from typing import Any

from ..config import ModelConfig
from ..registry import register
from .decoder import TransformersDecoder
from .moe import RULES, MoEDecoder, common_config
from .qwen3 import Qwen3


class Qwen3Moe(MoEDecoder, Qwen3):
    """``Qwen3MoeForCausalLM``: Qwen3's attention (q/k norms per head), experts ``moe_intermediate_size`` wide, dense
    layers from ``mlp_only_layers`` and ``decoder_sparse_step``, a sliding window on every layer with
    ``use_sliding_window``."""

    arch = "hf-qwen3-moe"
    model_types = ("qwen3_moe",)
    rules = {"qwen3_moe": RULES["qwen3_moe"]}
    expert_ffn_key = "moe_intermediate_size"
    experts_key = "num_local_experts"          # Qwen3MoeConfig maps num_experts to it
    default_experts, default_top_k = 128, 8
    defaults = {"qwen3_moe": {"max_position_embeddings": 32768, "moe_intermediate_size": 768,
                              "decoder_sparse_step": 1}}

    def design_fields(self, fields: dict[str, Any]) -> dict[str, Any]:
        bias = bool(fields.get("attention_bias", False))
        window = fields.get("sliding_window") if fields.get("use_sliding_window") else None
        return dict(qkv_bias=bias, out_bias=bias, sliding_window=window,
                    dropout=(0.0, float(fields.get("attention_dropout") or 0.0), 0.0),
                    extra=tuple(self.moe_fields(fields).items()))

    def dense_layers(self, fields: dict[str, Any]) -> tuple[int, ...]:
        """``Qwen3MoeDecoderLayer``: the sparse block where ``layer not in mlp_only_layers and num_experts > 0 and
        (layer + 1) % decoder_sparse_step == 0``, else a dense MLP ``intermediate_size`` wide."""
        only = set(fields.get("mlp_only_layers") or [])
        step = fields.get("decoder_sparse_step") or 1
        return tuple(i for i in range(fields["num_hidden_layers"]) if i in only or (i + 1) % step)

    def check_model(self, model: ModelConfig) -> None:
        MoEDecoder.check_model(self, model)
        if model.qkv_bias != model.out_bias or model.mlp_bias:
            raise ValueError("Qwen3-MoE's attention_bias sets the q/k/v and output biases together, and its MLPs have "
                             "none: expected qkv_bias == out_bias and mlp_bias False")

    def attention_parameters(self, model: ModelConfig) -> list[tuple]:
        return Qwen3.block_parameters(self, model)[:6]   # q, k, v, o, q_norm, k_norm

    def router_entries(self, model: ModelConfig) -> list[tuple]:
        return [*self._experts(model), self._router(model)]   # Qwen3MoeSparseMoeBlock makes the experts first

    def masks(self, r: Any, cached: bool) -> dict[str, Any]:
        return TransformersDecoder.masks(self, r, cached)   # one mask, sliding when a window is set

    def transformers_config(self, model: ModelConfig) -> Any:
        import transformers

        return transformers.Qwen3MoeConfig(**common_config(model), num_experts=model.setting("experts"),
                                           moe_intermediate_size=model.setting("expert_ffn"),
                                           norm_topk_prob=model.setting("normalize"), head_dim=model.head_dim,
                                           attention_bias=model.qkv_bias,
                                           use_sliding_window=model.sliding_window is not None,
                                           sliding_window=model.sliding_window,
                                           mlp_only_layers=list(model.setting("dense_layers")))


register(Qwen3Moe())
