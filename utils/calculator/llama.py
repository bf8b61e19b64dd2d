"""The ``"llama"`` design (``llama_like``: Llama as Hugging Face writes it): RMSNorm, rotary, its block."""

from __future__ import annotations

from typing import Callable

from .replay import _Replay, _T


class _LlamaBlock:
    """Mixin of ``_Step``: RMSNorm in float32, rotary embeddings, grouped-query attention, SwiGLU."""

    def rms_norm(self, x: _T, w: _T, label: str) -> _T:
        """Hugging Face's ``LlamaRMSNorm``: in float32, ``weight * (x * rsqrt(mean(x^2) + eps)).to(dtype)``."""
        rows = x.numel // self.model.d_model
        h = self.to_float(x, f"{label} x.float()", "activations")
        squared = self.unary(h, "Pow", f"{label} x^2", save_input=True, temps=2)
        variance = self.unary(squared, "Mean", f"{label} mean", numel=rows)
        self.rel(squared)
        shifted = self.add_scalar(variance, f"{label} + eps")
        inv = self.unary(shifted, "Rsqrt", f"{label} rsqrt", save_output=True, temps=2)
        self.rel(shifted)
        normed = self.mul(h, inv, f"{label} x * rsqrt")
        self.rel(inv, h)
        low = self.to_float(normed, f"{label} .to(dtype)", "activations", x.item)
        out = self.mul(w, low, label)
        self.rel(low, normed, variance)
        return out

    def rope(self, t: _T, cos: _T, sin: _T, label: str) -> _T:
        """``(t * cos) + (rotate_half(t) * sin)``, rotate_half(t) = ``cat((-t[..., h:], t[..., :h]), -1)``."""
        first = self.mul(t, cos, f"{label} * cos", numel=t.numel)
        x1 = self.slice_half(t, f"{label}[:h]")
        x2 = self.slice_half(t, f"{label}[h:]")
        minus = self.neg(x2, f"-{label}[h:]")
        rotated = self.cat2(minus, x1, f"rotate_half({label})")
        self.rel(minus, x1, x2)
        second = self.mul(rotated, sin, f"{label} rotated * sin", numel=t.numel)
        self.rel(rotated)
        out = self.add(first, second, f"{label} rotary")
        self.rel(first, second)
        return out

    def llama_block(self, layer: int, cos: _T, sin: _T) -> Callable[[_Replay, _T], _T]:
        prefix = f"layers.{layer}."
        model, setup = self.model, self.setup
        groups = model.num_heads // model.kv_heads
        lse = setup.micro_batch * model.num_heads * setup.seq_len

        def block(r: _Replay, x: _T) -> _T:
            n1 = self.rms_norm(x, self.p(prefix + "input_layernorm.weight"), prefix + "input_layernorm")
            views = []
            # the gradient reaching .view().transpose() is non-contiguous, and reshaping it copies, unless it
            # comes straight from attention's backward (v without repeat) or has one key/value head
            for name, copy_grad in (("self_attn.q_proj", True), ("self_attn.k_proj", model.kv_heads > 1),
                                    ("self_attn.v_proj", groups > 1 and model.kv_heads > 1)):
                out = self.lin(n1, prefix, name, True)     # .view(B, T, heads, hd).transpose(1, 2)
                views.append(self.reshape_copy(out, prefix + name, copy_grad))
                self.rel(out)
            q, k, v = views
            q_rot = self.rope(q, cos, sin, prefix + "query")
            self.rel(q)
            k_rot = self.rope(k, cos, sin, prefix + "key")
            self.rel(k)
            k_rep = self.repeat_kv(k_rot, groups, prefix + "repeat_kv(key)")
            self.rel(k_rot)
            v_rep = self.repeat_kv(v, groups, prefix + "repeat_kv(value)")
            self.rel(v)
            attended = self.sdpa(q_rot, k_rep, v_rep, lse, prefix + "attention")
            attn = self.lin(attended, prefix, "self_attn.o_proj", True)
            self.rel(attended, q_rot, k_rep, v_rep)
            self.rel(n1)
            x1 = self.add(x, attn, prefix + "residual 1")
            self.rel(attn)
            n2 = self.rms_norm(x1, self.p(prefix + "post_attention_layernorm.weight"),
                               prefix + "post_attention_layernorm")
            gate = self.lin(n2, prefix, "mlp.gate_proj", False)
            act = self.unary(gate, "Silu", prefix + "silu", save_input=True)
            self.rel(gate)
            up = self.lin(n2, prefix, "mlp.up_proj", False)
            product = self.mul(act, up, prefix + "silu * up")
            self.rel(act, up)
            down = self.lin(product, prefix, "mlp.down_proj", False)
            self.rel(product)
            self.rel(n2)
            x2 = self.add(x1, down, prefix + "residual 2")
            self.rel(down, x1)
            return x2

        return block

    def rotary(self) -> tuple[_T, _T]:
        """cos and sin for every position, in float32 then in the activations' dtype (no gradient)."""
        model, seq = self.model, self.setup.seq_len
        half, hd = model.head_dim // 2, model.head_dim
        item = 2 if self.setup.precision == "bf16" else 4
        positions = self.new(seq, 8, "activations", "positions")
        inv = self.new(half, 4, "temporaries", "inv_freq.float()") if item == 2 else None
        pos = self.new(seq, 4, "temporaries", "position_ids.float()")
        freqs = self.new(half * seq, 4, "temporaries", "inv_freq @ positions")
        emb = self.new(seq * hd, 4, "temporaries", "cat(freqs, freqs)")
        raw = self.new(seq * hd, 4, "temporaries", "emb.cos()")
        cos = self.new(seq * hd, 4, "activations", "cos")
        self.rel(raw)
        raw = self.new(seq * hd, 4, "temporaries", "emb.sin()")
        sin = self.new(seq * hd, 4, "activations", "sin")
        self.rel(raw)
        cos_out, sin_out = (self.to_float(t, "cos/sin .to(dtype)", "activations", item) for t in (cos, sin))
        self.rel(inv, pos, freqs, emb, cos, sin, positions)
        return cos_out, sin_out
