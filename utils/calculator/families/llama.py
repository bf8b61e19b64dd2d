"""transformers' Llama family: ``LlamaForCausalLM`` and the models that share its decoder layer, Mistral (every layer
sliding) and Qwen2 (q/k/v biases; sliding layers from ``max_window_layers`` on when ``use_sliding_window``).

The layer is ``decoder.py``'s default; what differs here is reading each config and the masks each model makes.
"""

from __future__ import annotations

from typing import Any

from ..config import ModelConfig
from ..registry import register
from .base import FieldRules
from .decoder import TransformersDecoder
from .hf_modules import causal_mask, generation_mask

_SHAPE = {"num_hidden_layers", "hidden_size", "num_attention_heads", "num_key_value_heads", "vocab_size",
          "intermediate_size", "head_dim", "hidden_act", "max_position_embeddings", "tie_word_embeddings",
          "use_cache", "attention_dropout", "rope_parameters", "rope_scaling"}
_ROPE_THETA = {"rope_theta": "a number inside inv_freq (the older place of rope_parameters' rope_theta)"}
RULES = {
    "llama": FieldRules(frozenset(_SHAPE | {"attention_bias", "mlp_bias"}),
                        {"pretraining_tp": "unused by transformers 5.24's LlamaForCausalLM", **_ROPE_THETA}),
    "mistral": FieldRules(frozenset(_SHAPE | {"sliding_window"}), dict(_ROPE_THETA)),
    "qwen2": FieldRules(frozenset(_SHAPE | {"use_sliding_window", "sliding_window", "max_window_layers",
                                            "layer_types"}),
                        {"use_mrope": "a key of older Qwen2 configs that transformers 5.24's Qwen2Config ignores",
                         **_ROPE_THETA}),
}


def qwen_layer_types(fields: dict[str, Any]) -> tuple[tuple[str, ...] | None, int | None]:
    """Qwen2's and Qwen3's ``layer_types`` and window as their configs compute them: ``sliding_window`` only with
    ``use_sliding_window``; without explicit ``layer_types``, sliding from ``max_window_layers`` on."""
    window = fields.get("sliding_window") if fields.get("use_sliding_window") else None
    types = fields.get("layer_types")
    layers = fields["num_hidden_layers"]
    if types is None:
        first = fields.get("max_window_layers", 28)
        types = ["sliding_attention" if window is not None and i >= first else "full_attention"
                 for i in range(layers)]
    types = tuple(types)
    if "sliding_attention" in types and window is None:
        raise ValueError("layer_types names sliding layers but use_sliding_window is False (transformers then has "
                         "no sliding_window and fails): expected use_sliding_window=True with a sliding_window")
    return (types if "sliding_attention" in types else None), (window if "sliding_attention" in types else None)


class Llama(TransformersDecoder):
    """``LlamaForCausalLM``, ``MistralForCausalLM``, ``Qwen2ForCausalLM``."""

    arch = "hf-llama"
    model_types = ("llama", "mistral", "qwen2")
    rules = RULES
    defaults = {"mistral": {"sliding_window": 4096, "max_position_embeddings": 131072},
                "qwen2": {"sliding_window": 4096, "max_window_layers": 28, "max_position_embeddings": 32768}}

    def design_fields(self, fields: dict[str, Any]) -> dict[str, Any]:
        model_type = fields["model_type"]
        bias = bool(fields.get("attention_bias", False))
        out: dict[str, Any] = dict(qkv_bias=bias or model_type == "qwen2", out_bias=bias,
                                   mlp_bias=bool(fields.get("mlp_bias", False)),
                                   dropout=(0.0, float(fields.get("attention_dropout") or 0.0), 0.0))
        if model_type == "mistral":
            out["sliding_window"] = fields.get("sliding_window") or None
        elif model_type == "qwen2":
            out["layer_types"], out["sliding_window"] = qwen_layer_types(fields)
        return out

    def masks(self, r: Any, cached: bool) -> dict[str, Any]:
        """Llama: ``create_causal_mask``; Mistral (a window, no ``layer_types``): the sliding one alone; Qwen2: the
        causal one, and the sliding one when a layer slides."""
        model = r.model
        if model.sliding_window is not None and model.layer_types is None:
            return {"sliding_attention": causal_mask(r, model.sliding_window, cached)}
        masks = {"full_attention": causal_mask(r, None, cached)}
        if model.layer_types is not None:
            masks["sliding_attention"] = causal_mask(r, model.sliding_window, cached)
        return masks

    generates = True

    def generating_masks(self, r: Any, q_len: int) -> dict[str, Any]:
        """Inside ``generate`` (no padding, sdpa): full layers run ``is_causal`` (no mask); a sliding layer's mask
        is built once the keys reach the window (``_ignore_causal_mask_sdpa``'s local size)."""
        model, cache = r.model, r.generating
        if cache.kind == "static":                        # made by prepare_inputs_for_generation: 4-D, passed in
            return {kind: (r.view(mask) if mask is not None else None) for kind, mask in cache.premade.items()}
        if model.sliding_window is None:
            return {}
        return {"sliding_attention": self._generation_mask(r, "sliding_attention", q_len, skip=True)}

    def prepared_masks(self, r: Any, q_len: int) -> dict[str, Any]:
        """``create_masks_for_generate`` in ``prepare_inputs_for_generation`` with a static cache (a compileable
        cache: no skipping the mask for one query token), each made ``.contiguous()`` (a copy over the rows)."""
        kind = r.model.layer_type(0)                      # one kind of layer (check_generation refuses two)
        mask = self._generation_mask(r, kind, q_len, skip=q_len > 1)
        if mask is None or r.rows == 1:                   # one row: the expanded mask is contiguous already
            return {kind: mask}
        whole = r.new(r.rows * mask.numel, 1, "activations", "mask.contiguous()")
        r.rel(mask)
        return {kind: whole}

    def _generation_mask(self, r: Any, kind: str, q_len: int, skip: bool) -> Any:
        """``sdpa_mask`` of the first layer of ``kind``, or None where ``_ignore_causal_mask_sdpa`` skips it."""
        model, cache = r.model, r.generating
        layer = next(i for i in range(model.num_layers) if model.layer_type(i) == kind)
        kv_len, _ = cache.mask_sizes(layer, q_len)
        window = model.sliding_window if kind == "sliding_attention" else None
        local = window is not None and kv_len >= window
        if skip and not local and (q_len == 1 or kv_len == q_len or cache.past(layer) == 0):
            return None
        return generation_mask(r, window, r.rows, q_len, kv_len)

    def transformers_config(self, model: ModelConfig) -> Any:
        """The transformers config of a ``ModelConfig`` of this family (for measuring it)."""
        import transformers

        common = dict(num_hidden_layers=model.num_layers, hidden_size=model.d_model,
                      num_attention_heads=model.num_heads, num_key_value_heads=model.kv_heads,
                      intermediate_size=model.ffn, vocab_size=model.vocab_size,
                      max_position_embeddings=model.max_seq_len, tie_word_embeddings=model.tied_embeddings,
                      use_cache=model.use_cache, attention_dropout=model.dropout[1])
        if model.layer_types is not None or (model.qkv_bias and not model.out_bias):
            return transformers.Qwen2Config(**common, use_sliding_window=model.layer_types is not None,
                                            sliding_window=model.sliding_window, layer_types=model.layer_types)
        if model.sliding_window is not None:
            return transformers.MistralConfig(**common, sliding_window=model.sliding_window, head_dim=model.head_dim)
        return transformers.LlamaConfig(**common, attention_bias=model.qkv_bias, mlp_bias=model.mlp_bias,
                                        head_dim=model.head_dim)


register(Llama())
