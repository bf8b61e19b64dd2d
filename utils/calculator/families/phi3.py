"""transformers' Phi-3 (``Phi3ForCausalLM``): Llama's design with fused projections (one ``qkv_proj`` whose output is
sliced into q, k and v; one ``gate_up_proj`` chunked in two), a rotary embedding written with slices and a ``cat``
(``partial_rotary_factor``), dropout on each residual branch (``resid_pdrop``), and a sliding window on every layer
when ``sliding_window`` is set (Phi-3-mini's 2047)."""

from __future__ import annotations

from typing import Any, Callable

from ..config import ModelConfig
from ..registry import register
from ..replay import _T
from .base import FieldRules
from .decoder import TransformersDecoder
from .hf_modules import copy_cat, maybe_dropout, rope
from .llama import RULES as LLAMA_RULES

RULES = {"phi3": FieldRules(
    frozenset((LLAMA_RULES["mistral"].replayed - {"head_dim"}) | {"resid_pdrop"}),
    {"embd_pdrop": "unused by transformers 5.24's Phi3Model (no embedding dropout)",
     "original_max_position_embeddings": "read by the long-context rotary scaling only, which is refused",
     **LLAMA_RULES["mistral"].no_effect})}


class Phi3(TransformersDecoder):
    """``Phi3ForCausalLM``."""

    arch = "hf-phi3"
    model_types = ("phi3",)
    rules = RULES
    residual_dropout = True
    rotated_layout = "contiguous"              # the rotary's cat makes q and k contiguous (B, H, T, hd)

    def design_fields(self, fields: dict[str, Any]) -> dict[str, Any]:
        return dict(sliding_window=fields.get("sliding_window") or None,
                    dropout=(0.0, float(fields.get("attention_dropout") or 0.0), float(fields.get("resid_pdrop") or 0.0)))

    def check_model(self, model: ModelConfig) -> None:
        super().check_model(model)
        if model.qkv_bias or model.out_bias or model.mlp_bias or model.layer_types is not None:
            raise ValueError("Phi-3 has no biases and one kind of layer: expected qkv_bias, out_bias, mlp_bias False "
                             "and layer_types None")

    def peft_default_targets(self, model: ModelConfig) -> tuple[str, ...]:
        raise ValueError("peft has no default target_modules for Phi-3: expected LoraConfig(target_modules=...), such "
                         "as ['qkv_proj', 'o_proj'] or 'all-linear'")

    def block_parameters(self, model: ModelConfig) -> list[tuple]:
        d, f, hd = model.d_model, model.ffn, model.head_dim
        q, kv = model.num_heads * hd, model.kv_heads * hd
        return [("linear", "self_attn.o_proj", q, d, False), ("linear", "self_attn.qkv_proj", d, q + 2 * kv, False),
                ("linear", "mlp.gate_up_proj", d, 2 * f, False), ("linear", "mlp.down_proj", f, d, False),
                ("norm", "input_layernorm", d), ("norm", "post_attention_layernorm", d)]

    def rope_with_cat(self, r: Any, t: _T, passed: _T, cos: _T, sin: _T, label: str) -> _T:
        """``cat([(t_rot * cos) + (rotate_half(t_rot) * sin), t_pass], -1)``: every dimension rotates, so
        ``t_rot = t[..., :rotary_dim]`` is t itself (an alias, no autograd node) and ``t_pass`` an empty slice,
        whose backward still writes a zero gradient of t's size; the cat copies the rotated t."""
        rotated = rope(r, t, cos, sin, label)
        out = r.cat2(rotated, passed, f"cat([{label} rotated, pass])")
        r.rel(rotated)
        return out

    def project_qkv(self, r: Any, prefix: str, n1: _T, cos: _T, sin: _T, mask: _T | None) -> tuple[_T, _T, _T]:
        """``qkv_proj(x)`` sliced into q, k, v (views), then each ``.view(B, T, heads, hd).transpose(1, 2)``; q and
        k rotated with Phi-3's slices and cat."""
        model = r.model
        groups = model.num_heads // model.kv_heads
        hd = model.head_dim
        rows = n1.numel // model.d_model
        qkv = self.linear(r, n1, prefix, "self_attn.qkv_proj")
        repeated_v = (model.attention == "eager" or (groups > 1 and mask is not None)
                      or (model.dropout[1] > 0 and r.device == "cpu"))
        parts = [r.slice_view(qkv, rows * heads * hd, f"{prefix}qkv[{name}]")
                 for name, heads in (("query", model.num_heads), ("key", model.kv_heads), ("value", model.kv_heads))]
        views = []
        for part, name, copy_grad in zip(parts, ("query", "key", "value"),
                                         (model.num_heads > 1, model.kv_heads > 1, repeated_v and model.kv_heads > 1)):
            views.append(r.reshape_copy(part, f"{prefix}{name} .view", copy_grad))
            r.rel(part)
        r.phi3_qkv = qkv                                 # a local of the attention's forward, until it returns
        q, k, v = views
        q_pass, k_pass = (r.slice_view(t, 0, f"{prefix}{name}[..., rotary_dim:]") for t, name in ((q, "query"),
                                                                                                   (k, "key")))
        q_rot = self.rope_with_cat(r, q, q_pass, cos, sin, prefix + "query")
        k_rot = self.rope_with_cat(r, k, k_pass, cos, sin, prefix + "key")
        r.rel(q, k, q_pass, k_pass)
        return q_rot, k_rot, v

    def self_attention(self, r: Any, layer: int, n1: _T, cos: _T, sin: _T, mask: _T | None,
                       cache: list[_T] | None) -> _T:
        attn = super().self_attention(r, layer, n1, cos, sin, mask, cache)
        r.rel(r.phi3_qkv)
        return attn

    def mlp(self, r: Any, prefix: str, n2: _T) -> _T:
        """``gate, up = gate_up_proj(x).chunk(2, -1)``; ``down_proj(up * act(gate))``."""
        fused = self.linear(r, n2, prefix, "mlp.gate_up_proj")
        gate, up = r.chunk2(fused, prefix + "gate_up .chunk(2)")
        r.rel(fused)
        act = self.activation(r, gate, prefix + "mlp.activation_fn")
        product = r.mul(up, act, prefix + "up * act(gate)")
        r.rel(up, act)
        down = self.linear(r, product, prefix, "mlp.down_proj")
        r.rel(product, gate)
        return down

    def block(self, r: Any, layer: int, cos_sin: tuple[_T, _T], mask: _T | None, cache: list[_T] | None) -> Callable:
        """``Phi3DecoderLayer.forward``: dropout on each branch before its residual add."""
        prefix = f"model.layers.{layer}."
        cos, sin = cos_sin
        p = r.model.dropout[2]

        def block(r_: Any, x: _T) -> _T:
            n1 = self.norm(r, x, r.p(prefix + "input_layernorm.weight"), prefix + "input_layernorm")
            attn = self.self_attention(r, layer, n1, cos, sin, mask, cache)
            weights = r.attention_weights                # eager's: the layer's `self_attn_weights`
            r.rel(n1)
            dropped = maybe_dropout(r, attn, p, prefix + "resid_attn_dropout")
            x1 = r.add(x, dropped, prefix + "residual 1")
            r.rel(dropped, attn)
            n2 = self.norm(r, x1, r.p(prefix + "post_attention_layernorm.weight"), prefix + "post_attention_layernorm")
            down = self.mlp(r, prefix, n2)
            r.rel(n2)
            dropped = maybe_dropout(r, down, p, prefix + "resid_mlp_dropout")
            x2 = r.add(x1, dropped, prefix + "residual 2")
            r.rel(dropped, down, x1, weights)
            return x2

        return block

    def transformers_config(self, model: ModelConfig) -> Any:
        import transformers

        return transformers.Phi3Config(
            num_hidden_layers=model.num_layers, hidden_size=model.d_model, num_attention_heads=model.num_heads,
            num_key_value_heads=model.kv_heads, intermediate_size=model.ffn, vocab_size=model.vocab_size,
            max_position_embeddings=model.max_seq_len, tie_word_embeddings=model.tied_embeddings,
            use_cache=model.use_cache, attention_dropout=model.dropout[1], resid_pdrop=model.dropout[2],
            sliding_window=model.sliding_window)


register(Phi3())
