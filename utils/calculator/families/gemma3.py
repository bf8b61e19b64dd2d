"""transformers' Gemma 3 language model (``Gemma3ForCausalLM``, ``model_type`` ``gemma3_text``): Gemma 2's design
(scaled embedding, four Gemma RMSNorms per layer, gelu-tanh MLP, both masks, an optional final logit soft-cap) with
an RMSNorm on each query and key head (``q_norm``, ``k_norm``, after the transpose), five sliding layers to one
global (``sliding_window_pattern``, or ``layer_types``), a rotary embedding per kind of layer present (local and
global frequencies: two buffers each, and a cos/sin pair each in every forward), and sdpa or eager attention
without score soft-capping. The multimodal ``gemma3`` config is refused: pass its ``text_config``."""

from __future__ import annotations

from typing import Any

from ..config import ModelConfig
from ..registry import register
from ..replay import _T
from .base import FieldRules, rope_settings
from .gemma2 import _GEMMA_SHAPE, GEMMA_NO_EFFECT, Gemma2
from .hf_modules import rope, rotary

RULES = {"gemma3_text": FieldRules(
    frozenset(_GEMMA_SHAPE | {"sliding_window_pattern"}),
    {**GEMMA_NO_EFFECT, "attn_logit_softcapping": "not passed to attention by transformers 5.24's Gemma3Attention",
     "rope_local_base_freq": "a number inside the local inv_freq (the older place of its rope_theta)"},
    {"use_bidirectional_attention": False})}


class Gemma3(Gemma2):
    """``Gemma3ForCausalLM``."""

    arch = "hf-gemma3"
    model_types = ("gemma3_text",)
    rules = RULES
    default_attention = "sdpa"
    pattern = 6
    defaults = {"gemma3_text": {"head_dim": 256, "hidden_activation": "gelu_pytorch_tanh", "sliding_window": 4096,
                                "final_logit_softcapping": None, "attn_logit_softcapping": None,
                                "tie_word_embeddings": True, "max_position_embeddings": 131072}}

    def default_layer_types(self, fields: dict[str, Any], layers: int) -> list[str]:
        pattern = fields.get("sliding_window_pattern", fields.get("_sliding_window_pattern", self.pattern))
        return ["sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(layers)]

    def read_config(self, fields: dict[str, Any], attention: str, name: str) -> ModelConfig:
        for kind in ("full_attention", "sliding_attention"):
            rope_settings(fields, kind)
        return super().read_config(fields, attention, name)

    def block_parameters(self, model: ModelConfig) -> list[tuple]:
        params = super().block_parameters(model)
        hd = model.head_dim                                # q_norm and k_norm are registered after o_proj
        return params[:4] + [("norm", "self_attn.q_norm", hd), ("norm", "self_attn.k_norm", hd)] + params[4:]

    def kinds(self, model: ModelConfig) -> list[str]:
        """The kinds of layer present (a rotary embedding, and its buffers, each)."""
        return sorted({model.layer_type(i) for i in range(model.num_layers)})

    def buffers(self, r: Any) -> None:
        item = 2 if r.setup.precision == "bf16" else 4
        r.embed_scale = r.new(1, item, "parameters", "embed_tokens.embed_scale")
        for kind in self.kinds(r.model):
            for name in ("inv_freq", "original_inv_freq"):
                r.incref(r._alloc(r.model.head_dim // 2 * item, "parameters", f"rotary_emb.{kind}_{name}"))

    def rotaries(self, r: Any) -> dict[str, tuple[_T, _T]]:
        """``position_embeddings[kind] = rotary_emb(x, position_ids, kind)`` for each kind present (the same bytes
        whichever comes first)."""
        return {kind: rotary(r, f"{kind} ") for kind in self.kinds(r.model)}

    def attend(self, r: Any, q: _T, k: _T, v: _T, mask: _T | None, label: str, cached: bool,
               softcap: bool = False) -> _T:
        return super(Gemma2, self).attend(r, q, k, v, mask, label, cached, False)

    def project_qkv(self, r: Any, prefix: str, n1: _T, cos: _T, sin: _T, mask: _T | None) -> tuple[_T, _T, _T]:
        """``q_norm(q_proj(x).view(B, T, H, hd).transpose(1, 2))``, the same for k; v as Llama's; q, k rotated."""
        model = r.model
        groups = model.num_heads // model.kv_heads
        repeated_v = (model.attention == "eager" or (groups > 1 and mask is not None)
                      or (model.dropout[1] > 0 and r.device == "cpu"))
        views = []
        for path, copy_grad in (("self_attn.q_proj", model.num_heads > 1), ("self_attn.k_proj", model.kv_heads > 1),
                                ("self_attn.v_proj", repeated_v and model.kv_heads > 1)):
            out = self.linear(r, n1, prefix, path)       # .view(B, T, heads, hd).transpose(1, 2)
            views.append(r.reshape_copy(out, prefix + path, copy_grad))
            r.rel(out)
        normed = []
        for t, name in zip(views[:2], ("self_attn.q_norm", "self_attn.k_norm")):   # query_states = q_norm(...)
            normed.append(self.norm(r, t, r.p(prefix + name + ".weight"), prefix + name, width=model.head_dim))
            r.rel(t)
        v = views[2]
        q_rot = rope(r, normed[0], cos, sin, prefix + "query")
        k_rot = rope(r, normed[1], cos, sin, prefix + "key")
        r.rel(*normed)
        return q_rot, k_rot, v

    def transformers_config(self, model: ModelConfig) -> Any:
        import transformers

        return transformers.Gemma3TextConfig(**self._config_fields(model))


register(Gemma3())
