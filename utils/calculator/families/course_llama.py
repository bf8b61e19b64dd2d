"""The course's ``"llama"`` design (``llama_like``: Llama as Hugging Face writes it, in plain PyTorch): RMSNorm in
float32, rotary embeddings, grouped-query attention (the key/value heads repeated before attention), SwiGLU, no
biases, the head tied to the embedding or not."""

from __future__ import annotations

from typing import Any, Callable

from ..config import ModelConfig, TrainingSetup
from ..registry import register
from ..replay import _T
from .course import CourseDesign
from .hf_modules import rms_norm, rope


class CourseLlama(CourseDesign):
    """``llama_like``, replayed op by op."""

    arch = "llama"
    block_prefix = "layers."

    def linears(self, model: ModelConfig) -> list[tuple[str, int, int, bool]]:
        d, f = model.d_model, model.ffn
        kv = model.kv_heads * model.head_dim
        return [("self_attn.q_proj", d, d, True), ("self_attn.k_proj", d, kv, True), ("self_attn.v_proj", d, kv, True),
                ("self_attn.o_proj", d, d, True), ("mlp.gate_proj", d, f, False), ("mlp.up_proj", d, f, False),
                ("mlp.down_proj", f, d, False)]

    def parameter_shapes(self, model: ModelConfig, setup: TrainingSetup) -> list[tuple[str, tuple[int, ...], bool]]:
        frozen = setup.lora_rank > 0
        d, v = model.d_model, model.vocab_size
        out = [("embed_tokens.weight", (v, d), not frozen)]
        for layer in range(model.num_layers):
            prefix = f"layers.{layer}."
            for name, _, _, _ in self.linears(model):
                self.linear_parameters(out, model, setup, prefix, name, False)
            out += [(prefix + "input_layernorm.weight", (d,), not frozen),
                    (prefix + "post_attention_layernorm.weight", (d,), not frozen)]
        out.append(("norm.weight", (d,), not frozen))
        if not model.tied_embeddings:
            out.append(("lm_head.weight", (v, d), not frozen))
        return out

    def tensor_parallel_dim(self, name: str, shape: tuple[int, ...]) -> int | None:
        owner, _, kind = name.rpartition(".")
        last = owner.rsplit(".", 1)[-1]
        if last in ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj", "embed_tokens", "lm_head"):
            return 0
        if last in ("o_proj", "down_proj"):
            return 1 if kind == "weight" else None
        return None

    def activation_design(self) -> str:
        return "llama"

    def layer_signature(self, model: ModelConfig, layer: int) -> str:
        return "block"

    def buffers(self, r: Any) -> None:
        """The rotary embedding's inv_freq buffer, in the model's dtype."""
        item = 2 if r.setup.precision == "bf16" else 4
        r.incref(r._alloc(r.model.head_dim // 2 * item, "parameters", "rotary.inv_freq"))

    def rotary(self, r: Any) -> tuple[_T, _T]:
        """cos and sin for every position, in float32 then in the activations' dtype (no gradient)."""
        model, seq = r.model, r.setup.seq_len
        half, hd = model.head_dim // 2, model.head_dim
        item = 2 if r.setup.precision == "bf16" else 4
        positions = r.new(seq, 8, "activations", "positions")
        inv = r.new(half, 4, "temporaries", "inv_freq.float()") if item == 2 else None
        pos = r.new(seq, 4, "temporaries", "position_ids.float()")
        freqs = r.new(half * seq, 4, "temporaries", "inv_freq @ positions")
        emb = r.new(seq * hd, 4, "temporaries", "cat(freqs, freqs)")
        raw = r.new(seq * hd, 4, "temporaries", "emb.cos()")
        cos = r.new(seq * hd, 4, "activations", "cos")
        r.rel(raw)
        raw = r.new(seq * hd, 4, "temporaries", "emb.sin()")
        sin = r.new(seq * hd, 4, "activations", "sin")
        r.rel(raw)
        cos_out, sin_out = (r.to_float(t, "cos/sin .to(dtype)", "activations", item) for t in (cos, sin))
        r.rel(inv, pos, freqs, emb, cos, sin, positions)
        return cos_out, sin_out

    def forward(self, r: Any, micro: int) -> _T:
        model, setup = r.model, r.setup
        x = r.embedding(r.p("embed_tokens.weight"), setup.tokens * model.d_model, "token embedding")
        cos, sin = self.rotary(r)
        x = r.run_layers(micro, x, lambda layer: self.block(r, layer, cos, sin), lambda layer: [cos, sin])
        r.set_phase(f"m{micro}.head")
        r.rel(cos, sin)
        final = rms_norm(r, x, r.p("norm.weight"), "norm")
        w = r.p("embed_tokens.weight" if model.tied_embeddings else "lm_head.weight")
        loss = self.head_loss(r, final, w, None)
        r.rel(x)
        return loss

    def block(self, r: Any, layer: int, cos: _T, sin: _T) -> Callable:
        """RMSNorm in float32, rotary embeddings, grouped-query attention, SwiGLU."""
        prefix = f"layers.{layer}."
        model, setup = r.model, r.setup
        groups = model.num_heads // model.kv_heads
        lse = setup.micro_batch * model.num_heads * setup.seq_len

        def block(r_: Any, x: _T) -> _T:
            n1 = rms_norm(r, x, r.p(prefix + "input_layernorm.weight"), prefix + "input_layernorm")
            views = []
            # the gradient reaching .view().transpose() is non-contiguous, and reshaping it copies, unless it
            # comes straight from attention's backward (v without repeat) or has one key/value head
            for name, copy_grad in (("self_attn.q_proj", True), ("self_attn.k_proj", model.kv_heads > 1),
                                    ("self_attn.v_proj", groups > 1 and model.kv_heads > 1)):
                out = self.lin(r, n1, prefix, name, True, False)     # .view(B, T, heads, hd).transpose(1, 2)
                views.append(r.reshape_copy(out, prefix + name, copy_grad))
                r.rel(out)
            q, k, v = views
            q_rot = rope(r, q, cos, sin, prefix + "query")
            r.rel(q)
            k_rot = rope(r, k, cos, sin, prefix + "key")
            r.rel(k)
            k_rep = r.repeat_kv(k_rot, groups, prefix + "repeat_kv(key)")
            r.rel(k_rot)
            v_rep = r.repeat_kv(v, groups, prefix + "repeat_kv(value)")
            r.rel(v)
            attended = r.sdpa(q_rot, k_rep, v_rep, lse, prefix + "attention")
            attn = self.lin(r, attended, prefix, "self_attn.o_proj", True, False)
            r.rel(attended, q_rot, k_rep, v_rep)
            r.rel(n1)
            x1 = r.add(x, attn, prefix + "residual 1")
            r.rel(attn)
            n2 = rms_norm(r, x1, r.p(prefix + "post_attention_layernorm.weight"), prefix + "post_attention_layernorm")
            gate = self.lin(r, n2, prefix, "mlp.gate_proj", False, False)
            act = r.unary(gate, "Silu", prefix + "silu", save_input=True)
            r.rel(gate)
            up = self.lin(r, n2, prefix, "mlp.up_proj", False, False)
            product = r.mul(act, up, prefix + "silu * up")
            r.rel(act, up)
            down = self.lin(r, product, prefix, "mlp.down_proj", False, False)
            r.rel(product)
            r.rel(n2)
            x2 = r.add(x1, down, prefix + "residual 2")
            r.rel(down, x1)
            return x2

        return block

    # -- the measured side ---------------------------------------------------------------------------------
    def build_reference_module(self, model: ModelConfig) -> Any:
        return llama_like(model)

    def reference_embed(self, net: Any, tokens: Any, seq_len: int) -> tuple[Any, tuple]:
        import torch

        x = net.embed_tokens(tokens)
        return x, net.rotary(x, torch.arange(seq_len, device=tokens.device).unsqueeze(0))    # cos, sin

    def reference_parts(self, net: Any) -> tuple[Any, Any]:
        return net.layers, net.lm_head


register(CourseLlama())


# --- llama_like: the module the measured side trains ----------------------------------------------------------

_LLAMA_CLASSES: dict[str, Any] = {}


def _llama_classes() -> dict[str, Any]:
    """The Llama-style modules, written as Hugging Face's ``modeling_llama`` writes them (made once, lazily)."""
    if _LLAMA_CLASSES:
        return _LLAMA_CLASSES
    import torch
    import torch.nn.functional as F
    from torch import nn

    class RMSNorm(nn.Module):
        """``weight * x / sqrt(mean(x^2) + eps)``, computed in float32 as Hugging Face's ``LlamaRMSNorm``."""

        def __init__(self, width: int, eps: float = 1e-6) -> None:
            super().__init__()
            self.weight = nn.Parameter(torch.ones(width))
            self.variance_epsilon = eps

        def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
            input_dtype = hidden_states.dtype
            hidden_states = hidden_states.to(torch.float32)
            variance = hidden_states.pow(2).mean(-1, keepdim=True)
            hidden_states = hidden_states * torch.rsqrt(variance + self.variance_epsilon)
            return self.weight * hidden_states.to(input_dtype)

    class Rotary(nn.Module):
        """cos and sin of the rotary position embedding, once per forward (``LlamaRotaryEmbedding``)."""

        def __init__(self, head_dim: int, base: float = 10000.0) -> None:
            super().__init__()
            inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
            self.register_buffer("inv_freq", inv_freq, persistent=False)
            self.attention_scaling = 1.0

        def forward(self, x: torch.Tensor, position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            inv_freq_expanded = self.inv_freq[None, :, None].float().expand(position_ids.shape[0], -1, 1)
            position_ids_expanded = position_ids[:, None, :].float()
            with torch.autocast(device_type=x.device.type, enabled=False):          # force float32
                freqs = (inv_freq_expanded.float() @ position_ids_expanded.float()).transpose(1, 2)
                emb = torch.cat((freqs, freqs), dim=-1)
                cos = emb.cos() * self.attention_scaling
                sin = emb.sin() * self.attention_scaling
            return cos.to(dtype=x.dtype), sin.to(dtype=x.dtype)

    def rotate_half(x: torch.Tensor) -> torch.Tensor:
        x1 = x[..., : x.shape[-1] // 2]
        x2 = x[..., x.shape[-1] // 2:]
        return torch.cat((-x2, x1), dim=-1)

    def repeat_kv(hidden_states: torch.Tensor, n_rep: int) -> torch.Tensor:
        batch, num_key_value_heads, slen, head_dim = hidden_states.shape
        if n_rep == 1:
            return hidden_states
        hidden_states = hidden_states[:, :, None, :, :].expand(batch, num_key_value_heads, n_rep, slen, head_dim)
        return hidden_states.reshape(batch, num_key_value_heads * n_rep, slen, head_dim)

    class Attention(nn.Module):
        def __init__(self, config: ModelConfig) -> None:
            super().__init__()
            d, hd = config.d_model, config.head_dim
            self.head_dim, self.groups = hd, config.num_heads // config.kv_heads
            self.q_proj = nn.Linear(d, config.num_heads * hd, bias=False)
            self.k_proj = nn.Linear(d, config.kv_heads * hd, bias=False)
            self.v_proj = nn.Linear(d, config.kv_heads * hd, bias=False)
            self.o_proj = nn.Linear(config.num_heads * hd, d, bias=False)

        def forward(self, hidden_states: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
            input_shape = hidden_states.shape[:-1]
            hidden_shape = (*input_shape, -1, self.head_dim)
            query_states = self.q_proj(hidden_states).view(hidden_shape).transpose(1, 2)   # (B, H, T, hd)
            key_states = self.k_proj(hidden_states).view(hidden_shape).transpose(1, 2)     # (B, KV, T, hd)
            value_states = self.v_proj(hidden_states).view(hidden_shape).transpose(1, 2)
            cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
            query_states = (query_states * cos) + (rotate_half(query_states) * sin)
            key_states = (key_states * cos) + (rotate_half(key_states) * sin)
            key_states = repeat_kv(key_states, self.groups)                               # (B, H, T, hd)
            value_states = repeat_kv(value_states, self.groups)
            attn_output = F.scaled_dot_product_attention(query_states, key_states, value_states, is_causal=True)
            attn_output = attn_output.transpose(1, 2).contiguous()
            attn_output = attn_output.reshape(*input_shape, -1).contiguous()
            return self.o_proj(attn_output)

    class MLP(nn.Module):
        def __init__(self, config: ModelConfig) -> None:
            super().__init__()
            self.gate_proj = nn.Linear(config.d_model, config.ffn, bias=False)
            self.up_proj = nn.Linear(config.d_model, config.ffn, bias=False)
            self.down_proj = nn.Linear(config.ffn, config.d_model, bias=False)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))

    class DecoderLayer(nn.Module):
        def __init__(self, config: ModelConfig) -> None:
            super().__init__()
            self.self_attn = Attention(config)
            self.mlp = MLP(config)
            self.input_layernorm = RMSNorm(config.d_model)
            self.post_attention_layernorm = RMSNorm(config.d_model)

        def forward(self, hidden_states: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
            residual = hidden_states
            hidden_states = self.input_layernorm(hidden_states)
            hidden_states = self.self_attn(hidden_states, cos, sin)
            hidden_states = residual + hidden_states
            residual = hidden_states
            hidden_states = self.post_attention_layernorm(hidden_states)
            hidden_states = self.mlp(hidden_states)
            hidden_states = residual + hidden_states
            return hidden_states

    class LlamaLike(nn.Module):
        """A Llama-style decoder (``arch="llama"``), as Hugging Face writes it, for measuring on the CPU.

        Shapes: tokens (batch, seq) int64 -> logits (batch, seq, vocab_size). ``forward`` is the whole
        model; ``reference_step`` calls its parts (``embed_tokens``, ``rotary``, ``layers``, ``norm``,
        ``lm_head``) so that it can checkpoint the layers.
        """

        def __init__(self, config: ModelConfig) -> None:
            super().__init__()
            self.embed_tokens = nn.Embedding(config.vocab_size, config.d_model)
            self.layers = nn.ModuleList(DecoderLayer(config) for _ in range(config.num_layers))
            self.norm = RMSNorm(config.d_model)
            self.rotary = Rotary(config.head_dim)
            self.lm_head = nn.Linear(config.d_model, config.vocab_size, bias=False)
            if config.tied_embeddings:
                self.lm_head.weight = self.embed_tokens.weight

        def forward(self, tokens: torch.Tensor) -> torch.Tensor:
            x = self.embed_tokens(tokens)
            cos, sin = self.rotary(x, torch.arange(tokens.shape[1], device=tokens.device).unsqueeze(0))
            for layer in self.layers:
                x = layer(x, cos, sin)
            return self.lm_head(self.norm(x))

    _LLAMA_CLASSES.update(LlamaLike=LlamaLike, RMSNorm=RMSNorm)
    return _LLAMA_CLASSES


def llama_like(model: ModelConfig):  # noqa: ANN201 - an nn.Module made lazily
    """A ``LlamaLike`` module for ``model`` (``arch="llama"``): Hugging Face's Llama, written out in plain PyTorch.

    RMSNorm in float32, rotary embeddings (cos and sin computed once per forward), q/k/v/o projections
    without bias, the key/value heads repeated to the query heads (``repeat_kv``) before
    ``F.scaled_dot_product_attention(is_causal=True)``, a SwiGLU MLP, a head tied to the embedding or not.
    """
    if not isinstance(model, ModelConfig) or model.arch != CourseLlama.arch:
        raise ValueError("llama_like builds arch 'llama' models: expected a ModelConfig with arch='llama'")
    return _llama_classes()["LlamaLike"](model)
