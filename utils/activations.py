"""The chunked cross-entropy of a language-model head: the logits never exist whole.

Introduced in notebook 08, which writes its core as a plain ``torch.autograd.Function`` (the recipe
``ChunkedCrossEntropy``) and measures it. This module holds the same Function with an optional bias,
``ignore_index`` and checks of its inputs, because later code reuses it: the memory calculator
(``utils.calculator``) models it op by op. Notebook 08's other levers (compile's
``activation_memory_budget``, saved-tensor hooks) are a few lines each and stay in the notebook.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .checks import positive_int

__all__ = ["chunked_cross_entropy", "validate_chunk_size"]


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
        count = valid.sum().clamp_(min=1)         # no valid target: a loss of 0 and zero gradients, not 0/0 = NaN
        ctx.save_for_backward(hidden, weight, bias, safe_targets, valid, count)
        ctx.chunk_size = chunk_size
        device = hidden.device.type          # backward recomputes the logits under the autocast state forward ran in
        ctx.autocast = (device, torch.get_autocast_dtype(device), torch.is_autocast_enabled(device))
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
            with torch.autocast(*ctx.autocast):
                logits = _chunk_logits(hidden_chunk, weight, bias)              # (C, V) float32, recomputed
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
        A float32 scalar, the mean loss over tokens whose target is not ``ignore_index``. When every target is
        ``ignore_index`` (a micro-batch of padding only) it is 0 and every gradient is 0, where
        ``F.cross_entropy``'s mean returns 0/0 = NaN (which one optimizer step would spread into every weight).

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
