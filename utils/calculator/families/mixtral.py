"""transformers' Mixtral (``MixtralForCausalLM``): Llama's attention, a sliding window on every layer when
``sliding_window`` is set, and in every layer the sparse MoE block of ``moe.py`` with the router's weights always
renormalised and kept float32; peft names its experts ``w1``, ``w3`` (gate and up) and ``w2`` (down)."""

from __future__ import annotations

from typing import Any

from ..config import ModelConfig
from ..registry import register
from .moe import RULES, MoEDecoder, common_config


class Mixtral(MoEDecoder):
    """``MixtralForCausalLM``: Llama's attention (a sliding window on every layer when ``sliding_window`` is set),
    the router's weights always renormalised and kept float32."""

    arch = "hf-mixtral"
    model_types = ("mixtral",)
    rules = {"mixtral": RULES["mixtral"]}
    router_casts_back = False
    always_renormalises = True
    experts_key = "num_local_experts"
    default_experts, default_top_k = 8, 2
    expert_targets = {"w1": "gate_up_proj", "w3": "gate_up_proj", "w2": "down_proj"}   # peft's Mixtral names
    defaults = {"mixtral": {"max_position_embeddings": 131072}}

    def design_fields(self, fields: dict[str, Any]) -> dict[str, Any]:
        return dict(sliding_window=fields.get("sliding_window") or None,
                    dropout=(0.0, float(fields.get("attention_dropout") or 0.0), 0.0),
                    extra=tuple(self.moe_fields(fields).items()))

    def transformers_config(self, model: ModelConfig) -> Any:
        import transformers

        return transformers.MixtralConfig(**common_config(model), num_local_experts=model.setting("experts"),
                                          sliding_window=model.sliding_window, head_dim=model.head_dim)


register(Mixtral())
