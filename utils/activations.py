"""Past checkpointing: compile's activation-memory budget, saved-tensor hooks, a chunked loss.

Introduced in notebook 08. Three levers that large-model trainers pull when checkpointing by hand
(notebook 03) is not enough:

* ``activation_memory_budget(budget)``: a validated context for ``torch.compile``'s knob
  ``torch._functorch.config.activation_memory_budget`` (private API), which lets the partitioner
  choose what to recompute so that the saved activations fit a fraction of what it would save.
* ``bf16_saved_activations``: saved-tensor hooks that store what autograd keeps for backward in
  bfloat16 and restore the original dtype when backward needs it (the mechanism offloading uses).
* ``chunked_cross_entropy``: a language-model head and its cross-entropy computed over chunks of
  tokens, each chunk recomputed in backward, so that the (tokens, vocabulary) logits never exist
  whole; same loss and gradients as ``F.cross_entropy(hidden @ weight.T + bias, targets)``.
"""

from __future__ import annotations

import contextlib
import math
import weakref
from dataclasses import dataclass
from typing import Any, Iterator

import torch
import torch.nn.functional as F

from .checks import positive_int
from .memory import _iter_tensors

__all__ = ["BudgetUnavailable", "Bf16PackStats", "bf16_saved_activations", "activation_memory_budget",
           "chunked_cross_entropy", "has_activation_memory_budget", "validate_memory_budget",
           "validate_chunk_size"]


class BudgetUnavailable(RuntimeError):
    """This torch has no ``torch._functorch.config.activation_memory_budget``."""


def has_activation_memory_budget() -> bool:
    """Whether this torch exposes ``torch._functorch.config.activation_memory_budget`` (2.4 and later)."""
    try:
        import torch._functorch.config as functorch_config
    except ImportError:  # pragma: no cover - every torch 2.x has it
        return False
    return hasattr(functorch_config, "activation_memory_budget")


def validate_memory_budget(budget: float) -> float:
    """Check an activation-memory budget and return it as a float.

    Args:
        budget: the fraction of the default saved activations that a compiled graph may keep:
            1.0 keeps what the default partitioner keeps, 0.0 recomputes everything it can.

    Returns:
        ``float(budget)``.

    Raises:
        TypeError: ``budget`` is not a real number (a bool is refused).
        ValueError: ``budget`` is outside [0, 1] or not finite.
    """
    if isinstance(budget, bool) or not isinstance(budget, (int, float)):
        raise TypeError(f"the activation memory budget must be a number in [0, 1], not {type(budget).__name__}")
    budget = float(budget)
    if not math.isfinite(budget) or not 0.0 <= budget <= 1.0:
        raise ValueError(f"the activation memory budget must be in [0, 1] (1 = save what the default "
                         f"partitioner saves, 0 = recompute all it can), got {budget}")
    return budget


@contextlib.contextmanager
def activation_memory_budget(budget: float, *, reset: bool = True) -> Iterator[float]:
    """Compile with a memory budget for saved activations inside the ``with`` block.

    ``torch.compile``'s partitioner (AOTAutograd's min-cut) decides which forward tensors to save
    for backward and which to recompute. With a budget below 1 it solves a knapsack: recompute
    the cheapest tensors until what is saved fits ``budget`` times the default. The setting is
    read when a graph is *compiled*, so by default Dynamo's caches are reset on entry and exit:
    the first call inside the block compiles afresh with the budget.

    Args:
        budget: fraction in [0, 1] (see ``validate_memory_budget``).
        reset: call ``torch._dynamo.reset()`` on entry and exit (leave True unless you manage
            Dynamo's caches yourself).

    Yields:
        The budget, as a float.

    Raises:
        TypeError / ValueError: a budget that is not a number in [0, 1].
        BudgetUnavailable: this torch has no such setting.

    Example:
        >>> with activation_memory_budget(0.5):
        ...     compiled = torch.compile(model)
        ...     compiled(x).sum().backward()     # compiled now, with the budget

    Known limitations:
        ``torch._functorch.config`` is private API: the name may change between releases
        (trainers such as torchtitan expose it as a config option and set it the same way).
        Compiled graphs made inside the block keep the choice they were compiled with.
    """
    budget = validate_memory_budget(budget)
    if not has_activation_memory_budget():
        raise BudgetUnavailable(f"torch {torch.__version__} has no torch._functorch.config.activation_memory_budget "
                                "(it appeared in torch 2.4)")
    import torch._dynamo
    import torch._functorch.config as functorch_config

    if reset:
        torch._dynamo.reset()
    try:
        with functorch_config.patch(activation_memory_budget=budget):
            yield budget
    finally:
        if reset:
            torch._dynamo.reset()


@dataclass
class Bf16PackStats:
    """What ``bf16_saved_activations`` converted.

    Attributes:
        converted_count: saved tensors stored in bf16 (a tensor saved twice is converted once).
        original_bytes: their bytes in their own dtype (float32: 4 per element).
        packed_bytes: their bytes as stored (2 per element).
        kept_count: saved tensors left as they were (not float32, excluded, or parameters).
    """

    converted_count: int = 0
    original_bytes: int = 0
    packed_bytes: int = 0
    kept_count: int = 0


class bf16_saved_activations(torch.autograd.graph.saved_tensors_hooks):  # noqa: N801 - a context manager
    """Store float32 tensors that autograd saves for backward in bfloat16; restore them in backward.

    Why: the activations kept for backward are usually the largest item of a training step's
    memory. Keeping them in half the bytes halves that item, at the cost of bf16 rounding (8 bits
    of mantissa) in the gradients: the forward pass itself is unchanged (still float32).

    The pack hook converts each saved float32 tensor to bf16 (a new tensor; the float32 original is
    freed when nothing else holds it); the unpack hook converts it back when backward needs it. A
    tensor saved by two operations (ReLU's output is also the next Linear's input) is converted
    once. Parameters (leaf tensors that require grad) and ``exclude`` are left alone: converting
    them would add a copy, not save one.

    Args:
        exclude: tensors not to convert (the input batch, which the caller holds anyway): a
            tensor, module or lists of them, as ``utils.tensor_bytes`` accepts.

    Attributes:
        stats: a ``Bf16PackStats``, filled in as tensors are saved.

    Example:
        >>> with bf16_saved_activations(exclude=x) as hooks:
        ...     loss = model(x).square().mean()
        >>> loss.backward()                 # gradients from bf16-rounded activations
        >>> hooks.stats.original_bytes - hooks.stats.packed_bytes   # bytes saved

    Known limitations:
        Gradients carry bf16 rounding (measured in notebook 08). Only float32 tensors are
        converted. Two different views of one storage are converted separately.
    """

    def __init__(self, exclude: Any = None) -> None:
        self._excluded = {t.untyped_storage()._cdata for t in _iter_tensors(exclude)}
        self.stats = Bf16PackStats()
        # (storage id, offset, shape, stride) -> (weakref to the storage, packed tensor): a tensor saved twice
        # is packed once; the weakref tells a live storage from a freed one whose id was reused
        self._packed: dict[tuple, tuple[weakref.ref, torch.Tensor]] = {}
        super().__init__(self._pack, self._unpack)

    def _pack(self, tensor: torch.Tensor) -> Any:
        storage = tensor.untyped_storage()
        base = tensor._base if tensor._base is not None else tensor    # weight.t() is a view of a parameter
        if (tensor.dtype != torch.float32 or storage._cdata in self._excluded
                or (base.is_leaf and base.requires_grad)):
            self.stats.kept_count += 1
            return tensor
        key = (storage._cdata, tensor.storage_offset(), tuple(tensor.shape), tuple(tensor.stride()))
        cached = self._packed.get(key)
        if cached is not None and cached[0]() is not None:
            return cached[1], tensor.dtype
        packed = tensor.detach().to(torch.bfloat16)
        self._packed[key] = (weakref.ref(storage), packed)
        self.stats.converted_count += 1
        self.stats.original_bytes += tensor.numel() * tensor.element_size()
        self.stats.packed_bytes += packed.numel() * packed.element_size()
        return packed, tensor.dtype

    @staticmethod
    def _unpack(packed: Any) -> torch.Tensor:
        if isinstance(packed, torch.Tensor):
            return packed
        tensor, dtype = packed
        return tensor.to(dtype)

    def __enter__(self) -> "bf16_saved_activations":
        super().__enter__()
        return self

    def __exit__(self, *exc_info: object) -> None:
        super().__exit__(*exc_info)
        self._packed = {}   # the autograd graph holds the packed tensors it needs; drop our references


def validate_chunk_size(chunk_size: int) -> int:
    """Check that a chunk size is a positive integer (a bool is refused) and return it.

    Raises:
        ValueError: not an int, or zero or negative.
    """
    return positive_int("chunk_size", chunk_size, "tokens per chunk")


def _chunk_logits(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """(C, D) @ (V, D).T (+ bias) in the head's dtype, then upcast to float32: (C, V) float32."""
    logits = F.linear(hidden, weight, bias)
    return logits.float()


class _ChunkedLinearCrossEntropy(torch.autograd.Function):
    """The head and the loss over chunks of tokens; backward recomputes each chunk's logits."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, chunk_size, ignore_index):  # noqa: ANN001, ANN205
        num_tokens = hidden.shape[0]
        valid = targets != ignore_index                                   # (N,)
        safe_targets = torch.where(valid, targets, torch.zeros_like(targets))
        total = torch.zeros((), dtype=torch.float32, device=hidden.device)
        for start in range(0, num_tokens, chunk_size):
            end = min(start + chunk_size, num_tokens)
            logits = _chunk_logits(hidden[start:end], weight, bias)       # (C, V) float32
            per_token = torch.logsumexp(logits, dim=-1) - logits.gather(1, safe_targets[start:end, None]).squeeze(1)
            del logits
            total += (per_token * valid[start:end]).sum()
        count = valid.sum()
        ctx.save_for_backward(hidden, weight, bias, safe_targets, valid, count)
        ctx.chunk_size = chunk_size
        return total / count

    @staticmethod
    def backward(ctx, grad_loss):  # noqa: ANN001, ANN205
        hidden, weight, bias, safe_targets, valid, count = ctx.saved_tensors
        chunk_size = ctx.chunk_size
        need_hidden, need_weight, need_bias = ctx.needs_input_grad[:3]
        grad_hidden = torch.empty_like(hidden) if need_hidden else None
        # accumulate the weight's gradient over chunks in float32, whatever the head's dtype
        grad_weight = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if need_weight else None
        grad_bias = torch.zeros(bias.shape, dtype=torch.float32, device=bias.device) \
            if (bias is not None and need_bias) else None
        scale = grad_loss / count                                         # d loss / d (sum of per-token losses)
        for start in range(0, hidden.shape[0], chunk_size):
            end = min(start + chunk_size, hidden.shape[0])
            hidden_chunk = hidden[start:end]
            logits = _chunk_logits(hidden_chunk, weight, bias)                  # (C, V) float32, recomputed
            probs = logits.softmax(dim=-1)
            del logits
            rows = torch.arange(end - start, device=probs.device)
            probs[rows, safe_targets[start:end]] -= 1.0                          # softmax - one_hot
            probs *= (valid[start:end, None] * scale)                            # mean over valid tokens
            if grad_hidden is not None:
                grad_hidden[start:end] = probs.to(weight.dtype) @ weight         # (C, D); to() is a no-op in fp32
            if grad_weight is not None:
                grad_weight.addmm_(probs.t(), hidden_chunk.float())              # (V, D) += (V, C) @ (C, D), in fp32
            if grad_bias is not None:
                grad_bias += probs.sum(dim=0)
            del probs
        if grad_weight is not None:
            grad_weight = grad_weight.to(weight.dtype)
        if grad_bias is not None:
            grad_bias = grad_bias.to(bias.dtype)
        return grad_hidden, grad_weight, grad_bias, None, None, None


def chunked_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, *,
                          bias: torch.Tensor | None = None, chunk_size: int = 1024,
                          ignore_index: int = -100) -> torch.Tensor:
    """Mean cross-entropy of a linear language-model head, without ever holding all the logits.

    Computes the same value as ``F.cross_entropy(F.linear(hidden, weight, bias).float().flatten(0, -2),
    targets.flatten(), ignore_index=ignore_index)`` but over ``chunk_size`` tokens at a time. The
    forward keeps only the per-token losses; backward recomputes each chunk's logits, turns them
    into ``softmax - one_hot`` and multiplies into the gradients of ``hidden``, ``weight`` and
    ``bias``. Memory for the logits falls from ``tokens × vocab`` to ``chunk_size × vocab``
    (float32), at the price of computing the head's matmul twice.

    Args:
        hidden: (..., d_model) the last hidden states (any float dtype).
        weight: (vocab, d_model) the head's weight, same dtype as ``hidden``.
        targets: (...) int64 token ids in [0, vocab) or ``ignore_index``; same leading shape as ``hidden``.
        bias: optional (vocab,) bias.
        chunk_size: tokens per chunk (a positive int); larger chunks, fewer and bigger matmuls.
        ignore_index: target value whose tokens add nothing to the loss (as in ``F.cross_entropy``).

    Returns:
        A float32 scalar, the mean loss over tokens whose target is not ``ignore_index``.

    Raises:
        TypeError: ``chunk_size`` is not an int, or ``targets`` is not an integer tensor.
        ValueError: a non-positive ``chunk_size``, or shapes that do not fit together (hidden's
            width vs the weight's, hidden's leading shape vs the targets', the bias's length).

    Example:
        >>> loss = chunked_cross_entropy(hidden, model.head.weight, targets, bias=model.head.bias, chunk_size=512)
        >>> loss.backward()

    Known limitations:
        Written for clarity, not speed: a Python loop of matmuls (fused GPU kernels such as Liger's,
        torchtune's or Apple's Cut Cross Entropy do this without the loop). Targets are not
        checked against the vocabulary (an out-of-range id raises inside ``gather``).
    """
    chunk_size = validate_chunk_size(chunk_size)
    for name, tensor in [("hidden", hidden), ("weight", weight), ("targets", targets)]:
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"{name} must be a tensor, not {type(tensor).__name__}")
    if weight.dim() != 2:
        raise ValueError(f"weight must be (vocab, d_model), got shape {tuple(weight.shape)}")
    if hidden.dim() < 2 or hidden.shape[-1] != weight.shape[1]:
        raise ValueError(f"hidden must be (..., d_model) with d_model = weight.shape[1] = {weight.shape[1]}, "
                         f"got shape {tuple(hidden.shape)}")
    if targets.dtype not in (torch.int64, torch.int32):
        raise TypeError(f"targets must hold int64 token ids, got dtype {targets.dtype}")
    if tuple(targets.shape) != tuple(hidden.shape[:-1]):
        raise ValueError(f"targets must have hidden's leading shape {tuple(hidden.shape[:-1])} (one token id per "
                         f"hidden state), got {tuple(targets.shape)}")
    if bias is not None and tuple(bias.shape) != (weight.shape[0],):
        raise ValueError(f"bias must be (vocab,) = ({weight.shape[0]},), got shape {tuple(bias.shape)}")
    if hidden.dtype != weight.dtype:
        raise ValueError(f"hidden ({hidden.dtype}) and weight ({weight.dtype}) must have the same dtype")
    flat_hidden = hidden.reshape(-1, hidden.shape[-1])           # (N, D)
    flat_targets = targets.reshape(-1).long()                    # (N,)
    return _ChunkedLinearCrossEntropy.apply(flat_hidden, weight, bias, flat_targets, chunk_size, ignore_index)
