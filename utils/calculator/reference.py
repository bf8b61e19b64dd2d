"""The measured side: the same step in plain PyTorch (``build_reference``, ``llama_like``, ``reference_step``)."""

from __future__ import annotations

from typing import Any

from .config import ModelConfig, TrainingSetup
from .shapes import _linears, _lora_on

def _torch():  # noqa: ANN202 - imported lazily: predicting needs no torch
    import torch

    return torch


def _lora_linear_class():  # noqa: ANN202
    torch = _torch()
    from torch import nn
    import torch.nn.functional as F

    class LoRALinear(nn.Module):
        """A frozen Linear plus a trainable low-rank update: ``base(x) + B(A(x)) * alpha / r`` (LoRA, Hu et al. 2021).

        A starts random and B at zero, so training starts from the base model.
        """

        def __init__(self, base: nn.Linear, rank: int, alpha: float = 16.0) -> None:
            super().__init__()
            self.base = base.requires_grad_(False)
            self.lora_a = nn.Parameter(torch.randn(rank, base.in_features, dtype=base.weight.dtype) / base.in_features**0.5)
            self.lora_b = nn.Parameter(torch.zeros(base.out_features, rank, dtype=base.weight.dtype))
            self.scale = alpha / rank

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.base(x) + F.linear(F.linear(x, self.lora_a), self.lora_b) * self.scale

    return LoRALinear


def build_reference(model: ModelConfig, setup: TrainingSetup, *, seed: int = 0, device: str = "cpu"):  # noqa: ANN201
    """The model and optimizer ``reference_step`` trains: a ``utils.TinyTransformer`` (or ``LlamaLike``).

    LoRA wraps the targeted Linear layers in ``LoRALinear`` and freezes everything else; pure bf16
    converts the model with ``.to(torch.bfloat16)``.

    Returns:
        ``(model, optimizer)`` on ``device``.
    """
    torch = _torch()
    from ..models import TinyTransformer

    torch.manual_seed(seed)
    if model.arch == "gpt":
        ratio, rest = divmod(model.ffn, model.d_model)   # TinyTransformer's MLP is mlp_ratio * d_model wide
        if rest:
            raise ValueError(f"arch 'gpt' builds utils.TinyTransformer, whose MLP is a multiple of d_model: expected "
                             f"ffn_width a multiple of {model.d_model}, got {model.ffn}")
        net = TinyTransformer(model.vocab_size, model.d_model, model.num_heads, model.num_layers,
                              max_seq_len=model.max_seq_len, mlp_ratio=ratio)
    else:
        net = llama_like(model)
    if setup.lora_rank:
        lora = _lora_linear_class()
        net.requires_grad_(False)
        blocks = net.blocks if model.arch == "gpt" else net.layers
        for block in blocks:
            for name, _, _, attention in _linears(model):
                if _lora_on(setup, attention):
                    parent, _, child = name.rpartition(".")
                    owner = block.get_submodule(parent) if parent else block
                    if child.isdigit():
                        owner[int(child)] = lora(owner[int(child)], setup.lora_rank)
                    else:
                        setattr(owner, child, lora(getattr(owner, child), setup.lora_rank))
    if setup.precision == "bf16":
        net = net.to(torch.bfloat16)
    net = net.to(device)
    params = [p for p in net.parameters() if p.requires_grad]
    impl = {"for-loop": {"foreach": False}, "foreach": {"foreach": True}, "fused": {"fused": True}}[setup.optimizer_impl]
    if setup.optimizer == "sgd":
        optimizer = torch.optim.SGD(params, lr=1e-3, **impl)
    elif setup.optimizer == "sgd_momentum":
        optimizer = torch.optim.SGD(params, lr=1e-3, momentum=0.9, **impl)
    elif setup.optimizer == "adam":
        optimizer = torch.optim.Adam(params, lr=1e-3, **impl)
    elif setup.optimizer == "adamw":
        optimizer = torch.optim.AdamW(params, lr=1e-3, **impl)
    elif setup.optimizer == "adafactor":
        optimizer = torch.optim.Adafactor(params, lr=1e-3, **impl)
    else:
        from ..lowbit import AdamW8bit

        optimizer = AdamW8bit(params, lr=1e-3)
    return net, optimizer


_LLAMA_CLASSES: dict[str, Any] = {}


def _llama_classes() -> dict[str, Any]:
    """The Llama-style modules, written as Hugging Face's ``modeling_llama`` writes them (made once, lazily)."""
    if _LLAMA_CLASSES:
        return _LLAMA_CLASSES
    torch = _torch()
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
    if not isinstance(model, ModelConfig) or model.arch != "llama":
        raise ValueError("llama_like builds arch 'llama' models: expected a ModelConfig with arch='llama'")
    return _llama_classes()["LlamaLike"](model)


def _save_matmuls_policy():  # noqa: ANN202
    torch = _torch()
    from torch.utils.checkpoint import CheckpointPolicy

    matmuls = {torch.ops.aten.mm.default, torch.ops.aten.addmm.default, torch.ops.aten.bmm.default}

    def policy(ctx, op, *args, **kwargs):  # noqa: ANN001, ANN202
        return CheckpointPolicy.MUST_SAVE if op in matmuls else CheckpointPolicy.PREFER_RECOMPUTE

    return policy


def reference_step(net, optimizer, tokens, targets, model: ModelConfig, setup: TrainingSetup,  # noqa: ANN001
                   mem: Any = None) -> None:
    """One training step exactly as the calculator replays it: plain PyTorch, nothing hidden.

    For each of ``setup.accumulation_steps`` micro-batches: the forward under ``torch.autocast`` when
    the precision says so, each block checkpointed (non-reentrant) when asked, the loss
    (``F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())`` or
    ``utils.chunked_cross_entropy``), ``(loss / accumulation_steps).backward()``; then
    ``optimizer.step()`` and ``optimizer.zero_grad(set_to_none=True)``.

    Args:
        net, optimizer: from ``build_reference``.
        tokens, targets: (accumulation_steps, micro_batch, seq_len) int64, contiguous.
        model, setup: what ``net`` was built from.
        mem: a ``MemoryMeasurement`` (optional): its phase is set at every block boundary, forward and
            backward, so that a timeline compares with the replay's.
    """
    torch = _torch()
    import torch.nn.functional as F
    from functools import partial
    from torch.utils.checkpoint import checkpoint, create_selective_checkpoint_contexts

    from ..activations import chunked_cross_entropy

    device_type = tokens.device.type
    autocast = setup.precision == "bf16-autocast"
    context_fn = partial(create_selective_checkpoint_contexts, _save_matmuls_policy())
    blocks = net.blocks if model.arch == "gpt" else net.layers
    for micro in range(setup.accumulation_steps):
        if mem is not None:
            mem.phase(f"m{micro}.embed")
        with torch.autocast(device_type, dtype=torch.bfloat16, enabled=autocast):
            if model.arch == "gpt":
                x = net.token_embedding(tokens[micro]) + net.position_embedding(
                    torch.arange(setup.seq_len, device=tokens.device))
                extra: tuple = ()
            else:
                x = net.embed_tokens(tokens[micro])
                extra = net.rotary(x, torch.arange(setup.seq_len, device=tokens.device).unsqueeze(0))  # cos, sin
            for index, block in enumerate(blocks):
                if mem is not None:
                    mem.phase(f"m{micro}.f{index}")
                if setup.checkpointing == "every_block":
                    x = checkpoint(block, x, *extra, use_reentrant=False)
                elif setup.checkpointing == "selective":
                    x = checkpoint(block, x, *extra, use_reentrant=False, context_fn=context_fn)
                else:
                    x = block(x, *extra)
                if mem is not None and x.requires_grad:
                    x.register_hook(lambda grad, name=f"m{micro}.b{index}": mem.phase(name))
            del extra
            if mem is not None:
                mem.phase(f"m{micro}.head")
            head = net.head if model.arch == "gpt" else net.lm_head
            if setup.chunked_loss:
                loss = chunked_cross_entropy(net.norm(x), head.weight, targets[micro], bias=head.bias,
                                             chunk_size=setup.chunked_loss)
            else:
                loss = F.cross_entropy(head(net.norm(x)).flatten(0, 1).float(), targets[micro].flatten())
            del x
            if mem is not None:
                mem.phase(f"m{micro}.exit")       # leaving autocast clears its cache of weight copies
        if mem is not None:
            mem.phase(f"m{micro}.bloss")
        (loss / setup.accumulation_steps).backward()
        del loss
    if mem is not None:
        mem.phase("optimizer")
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    if mem is not None:
        mem.phase("end")
