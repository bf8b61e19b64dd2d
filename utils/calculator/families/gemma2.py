"""transformers' Gemma 2 (``Gemma2ForCausalLM``): a scaled embedding (``embed_tokens(ids) * sqrt(hidden_size)``),
Gemma's RMSNorm (``x * rsqrt(mean(x^2)) * (1 + weight)``, all in float32) before and after each branch (four per
layer), a gelu-tanh MLP, eager attention with its scores soft-capped (``tanh(scores / cap) * cap``), alternating
sliding and global layers (``layer_types``; both masks made), and the logits soft-capped the same way before the
loss. transformers 5.24 runs Gemma 2 with eager attention only (it refuses sdpa for its soft-capping)."""

from __future__ import annotations

from typing import Any, Callable

from ..config import ModelConfig
from ..registry import register
from ..replay import _T
from .base import FieldRules
from .decoder import TransformersDecoder
from .hf_modules import causal_mask, gemma_rms_norm

_GEMMA_SHAPE = {"num_hidden_layers", "hidden_size", "num_attention_heads", "num_key_value_heads", "head_dim",
                "vocab_size", "intermediate_size", "hidden_activation", "hidden_act", "max_position_embeddings",
                "tie_word_embeddings", "use_cache", "attention_dropout", "attention_bias", "rope_parameters",
                "rope_scaling", "sliding_window", "layer_types", "final_logit_softcapping"}
GEMMA_NO_EFFECT = {"query_pre_attn_scalar": "a number the scores are scaled by",
                   "rope_theta": "a number inside inv_freq (the older place of rope_parameters' rope_theta)",
                   "cache_implementation": "the cache generate() builds; training makes its own DynamicCache",
                   "sliding_window_size": "an older name of sliding_window, which transformers 5.24 reads instead"}
RULES = {"gemma2": FieldRules(frozenset(_GEMMA_SHAPE | {"attn_logit_softcapping"}), dict(GEMMA_NO_EFFECT),
                              {"use_bidirectional_attention": None})}


class Gemma2(TransformersDecoder):
    """``Gemma2ForCausalLM``."""

    arch = "hf-gemma2"
    model_types = ("gemma2",)
    rules = RULES
    activations = ("gelu_pytorch_tanh",)
    default_attention = "eager"
    norm = staticmethod(gemma_rms_norm)
    pattern = 2                                  # every second layer global: sliding, full, sliding, ...
    defaults = {"gemma2": {"head_dim": 256, "hidden_activation": "gelu_pytorch_tanh", "sliding_window": 4096,
                           "final_logit_softcapping": 30.0, "attn_logit_softcapping": 50.0, "tie_word_embeddings": True,
                           "max_position_embeddings": 8192}}

    def design_fields(self, fields: dict[str, Any]) -> dict[str, Any]:
        layers = fields["num_hidden_layers"]
        types = fields.get("layer_types") or self.default_layer_types(fields, layers)
        window = fields.get("sliding_window")
        if "sliding_attention" in types and window is None:
            raise ValueError("layer_types names sliding layers: expected a sliding_window")
        caps = {name: float(fields[name]) for name in ("final_logit_softcapping", "attn_logit_softcapping")
                if fields.get(name) is not None and name in self.rules[self.model_types[0]].replayed}
        if fields.get("attention_bias"):
            raise ValueError("attention_bias=True is not modelled for Gemma (its projections have no bias in the "
                             "published models): expected False")
        return dict(layer_types=tuple(types), sliding_window=window,    # the sliding mask is made even unused
                    dropout=(0.0, float(fields.get("attention_dropout") or 0.0), 0.0), extra=tuple(caps.items()))

    def default_layer_types(self, fields: dict[str, Any], layers: int) -> list[str]:
        return ["sliding_attention" if (i + 1) % self.pattern else "full_attention" for i in range(layers)]

    def read_config(self, fields: dict[str, Any], attention: str, name: str) -> ModelConfig:
        if attention != "eager" and self.arch == "hf-gemma2":
            raise ValueError(f"attn_implementation {attention!r}: transformers 5.24 runs Gemma 2 with eager attention "
                             "only (it refuses sdpa, which has no soft-capping): expected 'eager'")
        return super().read_config(fields, attention, name)

    def check_model(self, model: ModelConfig) -> None:
        given = [name for name in ("qkv_bias", "out_bias", "mlp_bias") if getattr(model, name)]
        if given or model.activation is not None or model.dropout[0] or model.dropout[2]:
            raise ValueError(f"{', '.join(given) or 'activation or dropout'}: Gemma has no biases, one activation and "
                             "attention dropout only")
        unknown = set(dict(model.extra)) - {"final_logit_softcapping", "attn_logit_softcapping"}
        if unknown:
            raise ValueError(f"extra {sorted(unknown)}: Gemma reads final_logit_softcapping and attn_logit_softcapping")

    def block_parameters(self, model: ModelConfig) -> list[tuple]:
        d = model.d_model
        return super().block_parameters(model) + [("norm", "pre_feedforward_layernorm", d),
                                                  ("norm", "post_feedforward_layernorm", d)]

    def buffers(self, r: Any) -> None:
        """The embedding's scale (a 0-dim tensor) and the rotary embedding's two frequency buffers."""
        item = 2 if r.setup.precision == "bf16" else 4
        r.embed_scale = r.new(1, item, "parameters", "embed_tokens.embed_scale")
        super().buffers(r)

    def embed(self, r: Any) -> _T:
        """``Gemma2TextScaledWordEmbedding``: ``embedding(ids) * embed_scale.to(weight.dtype)``."""
        raw = super().embed(r)
        out = r.mul(raw, r.embed_scale, "token embedding * embed_scale", numel=raw.numel)
        r.rel(raw)
        return out

    def masks(self, r: Any, cached: bool) -> dict[str, Any]:
        """Both masks, always: ``create_causal_mask`` then ``create_sliding_window_causal_mask``."""
        return {"full_attention": causal_mask(r, None, cached),
                "sliding_attention": causal_mask(r, r.model.sliding_window, cached)}

    def activation(self, r: Any, x: _T, label: str) -> _T:
        return r.gelu(x, label)                          # gelu_pytorch_tanh: F.gelu(x, approximate="tanh")

    def head(self, r: Any, final: _T, w: _T) -> _T:
        """``lm_head``, then, with ``final_logit_softcapping``: ``tanh(logits / cap) * cap``."""
        logits = super().head(r, final, w)
        if r.model.setting("final_logit_softcapping") is None:
            return logits
        divided = r.mul_scalar(logits, "logits / softcap")
        r.rel(logits)
        capped = r.unary(divided, "Tanh", "tanh(logits)", save_output=True)
        r.rel(divided)
        out = r.mul_scalar(capped, "logits * softcap")
        r.rel(capped)
        return out

    def attend(self, r: Any, q: _T, k: _T, v: _T, mask: _T | None, label: str, cached: bool,
               softcap: bool = False) -> _T:
        return super().attend(r, q, k, v, mask, label, cached, r.model.setting("attn_logit_softcapping") is not None)

    def block(self, r: Any, layer: int, cos_sin: tuple[_T, _T], mask: _T | None, cache: list[_T] | None) -> Callable:
        """``Gemma2DecoderLayer.forward``: each branch normed before and after, then added to the residual."""
        prefix = f"model.layers.{layer}."
        cos, sin = cos_sin

        def norm(x: _T, name: str) -> _T:
            return self.norm(r, x, r.p(prefix + name + ".weight"), prefix + name)

        def block(r_: Any, x: _T) -> _T:
            n1 = norm(x, "input_layernorm")
            attn = self.self_attention(r, layer, n1, cos, sin, mask, cache)
            weights = r.attention_weights                # eager's, returned as `_`: a local of the layer
            r.rel(n1)
            post = norm(attn, "post_attention_layernorm")
            r.rel(attn)
            x1 = r.add(x, post, prefix + "residual 1")
            r.rel(post)
            n2 = norm(x1, "pre_feedforward_layernorm")
            down = self.mlp(r, prefix, n2)
            r.rel(n2)
            post = norm(down, "post_feedforward_layernorm")
            r.rel(down)
            x2 = r.add(x1, post, prefix + "residual 2")
            r.rel(post, x1, weights)
            return x2

        return block

    def transformers_config(self, model: ModelConfig) -> Any:
        import transformers

        return transformers.Gemma2Config(**self._config_fields(model),
                                         attn_logit_softcapping=model.setting("attn_logit_softcapping"))

    def _config_fields(self, model: ModelConfig) -> dict[str, Any]:
        return dict(num_hidden_layers=model.num_layers, hidden_size=model.d_model, num_attention_heads=model.num_heads,
                    num_key_value_heads=model.kv_heads, head_dim=model.head_dim, intermediate_size=model.ffn,
                    vocab_size=model.vocab_size, max_position_embeddings=model.max_seq_len,
                    tie_word_embeddings=model.tied_embeddings, use_cache=model.use_cache,
                    attention_dropout=model.dropout[1], sliding_window=model.sliding_window,
                    layer_types=model.layer_types, final_logit_softcapping=model.setting("final_logit_softcapping"))


register(Gemma2())
