"""The measured side of the course's designs: the same step in plain PyTorch (``build_reference``,
``reference_step``; the modules are the families': ``utils.TinyTransformer`` and ``llama_like``)."""

from __future__ import annotations

from typing import Any

from . import registry
from .config import ModelConfig, TrainingSetup

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
    family = registry.family_of(model.arch)

    torch.manual_seed(seed)
    net = family.build_reference_module(model)
    if setup.lora_rank:
        lora = _lora_linear_class()
        net.requires_grad_(False)
        blocks, _ = family.reference_parts(net)
        for block in blocks:
            for name, _, _, attention in family.linears(model):
                if family.lora_on(setup, attention):
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
    family = registry.family_of(model.arch)
    blocks, head = family.reference_parts(net)
    for micro in range(setup.accumulation_steps):
        if mem is not None:
            mem.phase(f"m{micro}.embed")
        with torch.autocast(device_type, dtype=torch.bfloat16, enabled=autocast):
            x, extra = family.reference_embed(net, tokens[micro], setup.seq_len)
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
