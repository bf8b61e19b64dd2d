"""The decoder's hooks for ``generate`` (calculator/generate.py) and for logits of some positions only (the RL
step's ``logits_to_keep``): a mixin of ``TransformersDecoder``, kept apart so that the training replay stays one
module of one sitting."""

from __future__ import annotations

from typing import Any

from ..config import ModelConfig
from ..replay import _T


class GeneratingDecoder:
    """``TransformersDecoder``'s forward inside ``generate`` (eval mode, no gradient, the cache's ``update``)."""

    generates = False                  # whether this family's generate is replayed (and measured: the Llama family)

    def check_generation(self, model: ModelConfig) -> None:
        """Refuse a model whose ``generate`` the replay does not model (before any work)."""
        if not self.generates:
            raise ValueError(f"generation is replayed for transformers' Llama, Mistral and Qwen2 (their decoder is "
                             f"the one measured against generate): {model.name} ({self.arch}) is not modelled")
        if model.attention != "sdpa":
            raise ValueError(f"generation is replayed with sdpa attention: attn_implementation {model.attention!r} "
                             "is not modelled (expected 'sdpa')")

    def generating_masks(self, r: Any, q_len: int) -> dict[str, _T | None]:
        """The masks of one forward inside ``generate`` (no padding: full layers run sdpa's ``is_causal``)."""
        return {}

    def generating_forward(self, r: Any, q_len: int, keep: int) -> _T:
        """One forward inside ``generate`` (no gradient, eval mode): ``model(input_ids, position_ids=..., cache=...,
        logits_to_keep=keep)`` of ``r.rows`` rows of ``q_len`` tokens; returns its logits. ``r.generating`` is the
        cache (``generate._GenCache``); the position ids are generate's."""
        model = r.model
        x = self.embed(r)
        inputs_embeds = r.view(x)                        # LlamaModel.forward's local, alive until it returns
        masks = self.generating_masks(r, q_len)
        rotaries = self.rotaries(r)
        for layer in range(model.num_layers):
            kind = model.layer_type(layer)
            out = self.block(r, layer, rotaries[kind], masks.get(kind), None)(r, x)
            r.rel(x)
            x = out
        final = self.norm(r, x, r.p("model.norm.weight"), "model.norm")
        r.rel(x)
        r.rel(inputs_embeds, *masks.values())
        for cos, sin in {id(pair): pair for pair in rotaries.values()}.values():
            r.rel(cos, sin)
        w = r.p("model.embed_tokens.weight" if model.tied_embeddings else "lm_head.weight")
        kept = kept_positions(r, final, keep, r.rows, q_len, w)
        logits = self.head(r, kept, w)
        if kept is not final:
            r.rel(kept)
        r.rel(final)                                     # the model's output object goes: its last hidden state
        return logits

    def generating_attention(self, r: Any, layer: int, n1: _T, cos: _T, sin: _T, mask: _T | None) -> _T:
        """``LlamaAttention.forward`` inside ``generate``: the cache's ``update``, then ``sdpa_attention_forward``
        (grouped-query attention through ``enable_gqa`` without a mask, ``pack_gqa`` for one query token with one,
        ``repeat_kv`` otherwise)."""
        prefix = f"model.layers.{layer}."
        model = r.model
        r.attention_weights = None
        q_rot, k_rot, v = self.project_qkv(r, prefix, n1, cos, sin, mask)
        k_all, v_all = r.generating.update(r, layer, k_rot, v)
        r.rel(k_rot, v)
        groups = model.num_heads // model.kv_heads
        q_len = q_rot.numel // (r.rows * model.num_heads * model.head_dim)
        kv_len = k_all.numel // (r.rows * model.kv_heads * model.head_dim)
        if groups > 1 and mask is not None and q_len > 1:
            k, v2 = (r.repeat_kv(t, groups, prefix + f"repeat_kv({name})") for t, name in ((k_all, "key"),
                                                                                       (v_all, "value")))
        else:
            k, v2 = r.view(k_all), r.view(v_all)
        mask_numel = r.rows * q_len * kv_len if mask is not None else None
        out = r.sdpa(q_rot, k, v2, r.rows * model.num_heads * q_len, prefix + "attention", mask_numel)
        r.rel(k, v2)
        attn = self.linear(r, out, prefix, "self_attn.o_proj")
        r.rel(out, q_rot, k_all, v_all)
        return attn


def kept_positions(r: Any, final: _T, keep: int, rows: int, length: int, w: _T) -> _T:
    """``slice_logits_to_keep(hidden_states, keep)``: the last ``keep`` positions (0: all) of the (rows, length, d)
    last hidden state, as the head's matmul reads them: a view where the rows fold into one matrix (all positions,
    one row, or one position); else, when the head's weight requires grad (in any grad mode), ``matmul`` folds
    them by a copy (``reshape``: the slice of several rows is not one stride apart), which autograd then keeps
    instead of the hidden state; with a frozen head it runs ``bmm`` on the view."""
    if not keep or keep >= length:
        return final
    sliced = r.slice_view(final, rows * keep * r.model.d_model, "hidden_states[:, -keep:]")
    if rows == 1 or keep == 1 or not w.rg:
        return sliced
    n = r.node("CloneBackward reshape of the kept positions", [(sliced, "pass")])
    copy = r.output(r.new(sliced.numel, sliced.item, "activations", "kept positions (reshape copy)"), n)
    r.rel(sliced)
    return copy


