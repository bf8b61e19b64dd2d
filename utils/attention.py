"""Predicting what long sequences cost: attention's saved bytes, a transformer layer's activations, padding.

Introduced in notebook 11 (long sequences). These are instruments: formulas that predict, before anything
runs, the bytes autograd keeps for backward, so that the notebook can put each prediction next to
``utils.track_saved_tensors``'s measurement (equal to the byte on the CPU). The techniques themselves (naive
attention, the online softmax, the document mask, packing) are written in plain torch in the notebook.

What the formulas count, for query, key and value of shape ``(B, H, L, D)`` in a dtype of ``e`` bytes:

* ``"naive"``: notebook 11's ``(q @ kᵀ / √D).masked_fill(~causal, -inf).softmax(-1) @ v``: q and k for the
  first matmul, the probabilities (``B·H·L²`` elements) for softmax's backward and the second matmul, v, and
  the ``L × L`` boolean mask that ``masked_fill`` keeps (one byte per entry, shared by batch and heads).
* ``"math"``: ``scaled_dot_product_attention``'s math backend, the same matmuls without the boolean mask (it
  adds a float mask, and an addition keeps nothing); 16-bit inputs are computed in fp32 unless
  ``torch.backends.cuda.allow_fp16_bf16_reduction_math_sdp(True)``, so the kept tensors are fp32.
* ``"flash"``: a fused kernel (FlashAttention on the CPU and CUDA; CUDA's memory-efficient and cuDNN kernels
  keep the same tensors): q, k, v, the output and one fp32 log-sum-exp per query row. No ``L × L`` term.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

import torch

from .checks import positive_int, positive_number

KERNELS = ("naive", "math", "flash")
LOW_PRECISION = (torch.float16, torch.bfloat16)


def _element_bytes(dtype: torch.dtype) -> int:
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise TypeError(f"dtype must be a floating-point torch.dtype (torch.float32, torch.bfloat16, ...), "
                        f"got {dtype!r}")
    return torch.empty((), dtype=dtype).element_size()


def _kernel(kernel: str) -> str:
    if kernel not in KERNELS:
        raise ValueError(f"kernel must be one of {KERNELS}, got {kernel!r}")
    return kernel


def attention_saved_bytes(batch: int, heads: int, seq_len: int, head_dim: int, *, dtype: torch.dtype = torch.float32,
                          kernel: str = "naive", causal: bool = True) -> int:
    """Bytes one attention call keeps for backward, q, k and v included, predicted from the shapes.

    Why: naive attention keeps ``B·H·L²`` probabilities for backward, which is what runs out of memory at long
    sequence lengths; a fused kernel keeps only ``O(L)``. The prediction says by how much before anything runs.

    Args:
        batch: ``B``, sequences.
        heads: ``H``, attention heads.
        seq_len: ``L``, tokens per sequence (queries and keys).
        head_dim: ``D``, features per head.
        dtype: the dtype of q, k and v.
        kernel: ``"naive"`` (notebook 11's written-out attention), ``"math"`` or ``"flash"`` (the two
            ``scaled_dot_product_attention`` backends a CPU has; see the module docstring).
        causal: whether the call is causal; only the naive attention's boolean mask depends on it.

    Returns:
        The bytes of the distinct storages saved, counting q, k and v (contiguous ``(B, H, L, D)`` tensors
        that require grad), as ``utils.track_saved_tensors`` measures them (exact on the CPU).

    Raises:
        ValueError: a size that is not a positive int, or an unknown kernel.
        TypeError: a dtype that is not a floating-point ``torch.dtype``.

    Example:
        >>> attention_saved_bytes(1, 2, 256, 16, kernel="flash")   # q, k, v, output, log-sum-exp
        133120
    """
    for name, value in [("batch", batch), ("heads", heads), ("seq_len", seq_len), ("head_dim", head_dim)]:
        positive_int(name, value)
    element = _element_bytes(dtype)
    kernel = _kernel(kernel)
    vectors = batch * heads * seq_len * head_dim          # elements of one of q, k, v
    scores = batch * heads * seq_len * seq_len            # elements of the probability matrix
    if kernel == "flash":
        return 4 * vectors * element + 4 * batch * heads * seq_len
    if kernel == "math":
        computed = 4 if dtype in LOW_PRECISION else element   # the math backend upcasts 16-bit inputs
        return 3 * vectors * computed + scores * computed
    return 3 * vectors * element + scores * element + (seq_len * seq_len if causal else 0)


@dataclass(frozen=True)
class LayerActivations:
    """Bytes one transformer block keeps for backward, split by how they grow with the sequence length.

    Attributes:
        linear_bytes: the part proportional to ``L`` (the residual stream, norms, projections, the MLP).
        quadratic_bytes: the part proportional to ``L²`` (attention's probabilities and mask; 0 for SDPA).
        seq_len: the ``L`` both parts were computed at.
    """

    linear_bytes: int
    quadratic_bytes: int
    seq_len: int

    @property
    def total_bytes(self) -> int:
        """Everything the block keeps: ``linear_bytes + quadratic_bytes``."""
        return self.linear_bytes + self.quadratic_bytes

    @property
    def crossover_length(self) -> float:
        """The sequence length at which the ``L²`` part equals the ``L`` part (``inf`` when there is no ``L²``)."""
        if self.quadratic_bytes == 0:
            return math.inf
        return self.seq_len * self.linear_bytes / self.quadratic_bytes


def layer_activation_bytes(batch: int, seq_len: int, d_model: int, num_heads: int, *,
                           dtype: torch.dtype = torch.float32, attention: str = "flash", mlp_ratio: int = 4,
                           device: torch.device | str = "cpu") -> LayerActivations:
    """Bytes one ``utils.TransformerBlock`` keeps for backward: the Playbook's formula re-derived for it.

    Why: Korthikanti et al. count ``s·b·h·(34 + 5·a·s/h)`` bytes per layer for a standard block in 16-bit with
    dropout (``utils.playbook_layer_activation_bytes``). ``utils.TransformerBlock`` (pre-norm, no dropout,
    ``mlp_ratio``-wide MLP) keeps, per token, ``(8 + 2·mlp_ratio)`` vectors of ``d_model`` elements (16 with a
    4× MLP): the block input and the mid-block residual (the two norms' inputs), both norms' outputs, q, k and
    v, the attention output, the MLP's hidden layer before and after GELU. Then two statistics per norm, the
    fused kernels' log-sum-exp (``H`` fp32 values per token), and with naive or math attention the
    ``B·H·L²`` probabilities (plus the naive attention's ``L²``-byte boolean mask). In 16-bit (``e = 2``) that
    is ``s·b·h·(32 + 2·a·s/h)`` plus the small terms: the Playbook's 34 counts two dropout masks (1 byte each)
    and its ``5·a·s/h`` the attention dropout's mask (1) and output (2), which a block without dropout lacks.

    Args:
        batch: sequences, ``b``.
        seq_len: tokens per sequence, ``s`` (``L``).
        d_model: width of the residual stream, ``h``.
        num_heads: attention heads, ``a``; must divide ``d_model``.
        dtype: the dtype the block computes in.
        attention: ``"naive"`` (notebook 11's written-out attention), ``"math"`` or ``"flash"`` (a fused
            ``scaled_dot_product_attention`` kernel: nothing of size ``L²``).
        mlp_ratio: the MLP's hidden width as a multiple of ``d_model``.
        device: where the block runs: LayerNorm keeps its statistics in the input's dtype on the CPU and in
            fp32 on CUDA.

    Returns:
        A ``LayerActivations``: ``linear_bytes``, ``quadratic_bytes``, their total and the crossover length.

    Raises:
        ValueError: a size that is not a positive int, ``num_heads`` that does not divide ``d_model``, or an
            unknown attention.
        TypeError: a dtype that is not a floating-point ``torch.dtype``.

    Example:
        >>> layer_activation_bytes(2, 64, 32, 4, attention="flash").total_bytes   # measured: 266240 on a CPU
        266240

    Known limitations:
        Exact on the CPU for the block's forward as ``utils.TransformerBlock`` writes it (q, k and v as views
        of one projection). Which tensors are copies depends on layout: with the math backend in fp32 and
        ``batch == 1`` or one head, v reaches the batched matmul as a view, so the whole qkv projection
        stays (two vectors more per token) instead of a copy of v. On CUDA the fused kernels also keep their
        RNG seed and offset (a few bytes) and the memory-efficient kernel pads the log-sum-exp to a multiple
        of 32 rows.
    """
    for name, value in [("batch", batch), ("seq_len", seq_len), ("d_model", d_model), ("num_heads", num_heads),
                        ("mlp_ratio", mlp_ratio)]:
        positive_int(name, value)
    if d_model % num_heads:
        raise ValueError(f"num_heads ({num_heads}) must divide d_model ({d_model}): each head gets "
                         f"d_model // num_heads features, and {d_model} / {num_heads} is not a whole number")
    element = _element_bytes(dtype)
    attention = _kernel(attention)
    on_cuda = torch.device(device).type == "cuda"
    stats = 4 if on_cuda and dtype in LOW_PRECISION else element
    tokens = batch * seq_len
    vectors = 8 + 2 * mlp_ratio            # d_model-sized vectors per token (see above)
    per_token = vectors * d_model * element + 4 * stats
    quadratic = 0
    if attention == "flash":
        per_token += 4 * num_heads                                   # fp32 log-sum-exp per head
    elif attention == "math" and dtype in LOW_PRECISION:
        per_token += 3 * d_model * (4 - element)                     # q, k, v upcast: fp32 copies
        quadratic = batch * num_heads * seq_len * seq_len * 4         # and fp32 probabilities
    elif attention == "math":
        if batch == 1 or num_heads == 1:   # v needs no copy for the batched matmul: a view of the qkv
            per_token += 2 * d_model * element   # projection keeps all three of its vectors alive
        quadratic = batch * num_heads * seq_len * seq_len * element
    else:
        quadratic = batch * num_heads * seq_len * seq_len * element + seq_len * seq_len
    return LayerActivations(linear_bytes=tokens * per_token, quadratic_bytes=quadratic, seq_len=seq_len)


def playbook_layer_activation_bytes(seq_len: int, batch: int, d_model: int, num_heads: int) -> int:
    """The Ultra-Scale Playbook's activation bytes of one standard transformer layer: ``s·b·h·(34 + 5·a·s/h)``.

    From Korthikanti et al., *Reducing Activation Recomputation in Large Transformer Models* (2022): a
    post-LayerNorm block in 16-bit with dropout after attention's softmax and after both residual branches.
    ``utils.layer_activation_bytes`` is the same count re-derived for ``utils.TransformerBlock``.

    Args:
        seq_len: ``s``, tokens per sequence.
        batch: ``b``, sequences.
        d_model: ``h``, the hidden width.
        num_heads: ``a``, attention heads.

    Returns:
        ``34·s·b·h + 5·a·s²·b`` bytes.

    Example:
        >>> playbook_layer_activation_bytes(2048, 1, 4096, 32)
        956301312
    """
    for name, value in [("seq_len", seq_len), ("batch", batch), ("d_model", d_model), ("num_heads", num_heads)]:
        positive_int(name, value)
    return 34 * seq_len * batch * d_model + 5 * num_heads * seq_len * seq_len * batch


def _lengths(lengths: Sequence[int]) -> list[int]:
    if isinstance(lengths, torch.Tensor):
        lengths = lengths.tolist()
    if isinstance(lengths, (str, bytes)) or not isinstance(lengths, Sequence) or len(lengths) == 0:
        raise ValueError(f"lengths must be a non-empty sequence of positive ints (tokens per document), "
                         f"got {lengths!r}")
    for index, length in enumerate(lengths):
        positive_int(f"lengths[{index}]", length, "tokens in that document")
    return list(lengths)


def padding_fraction(lengths: Sequence[int], *, pad_to: int | None = None) -> float:
    """The share of a padded batch's tokens that are padding, predicted from the documents' lengths.

    Why: a padded batch is ``len(lengths) × pad_to`` tokens, of which only ``sum(lengths)`` are real; every
    per-token cost (activations, matmuls) is paid on the rest too.

    Args:
        lengths: tokens per document (positive ints; a list or a 1-D tensor).
        pad_to: the padded length (default: the longest document, what a collator pads to); must be at
            least the longest document.

    Returns:
        ``1 - sum(lengths) / (len(lengths) * pad_to)``, between 0 and 1.

    Raises:
        ValueError: an empty list, a length that is not a positive int, or ``pad_to`` shorter than a document.

    Example:
        >>> padding_fraction([3, 1, 4])
        0.3333333333333333
    """
    lengths = _lengths(lengths)
    longest = max(lengths)
    if pad_to is None:
        pad_to = longest
    positive_int("pad_to", pad_to, "tokens per padded row")
    if pad_to < longest:
        raise ValueError(f"pad_to ({pad_to}) must be at least the longest document ({longest} tokens)")
    return 1 - sum(lengths) / (len(lengths) * pad_to)


def sample_document_lengths(num_documents: int, *, mean_length: float, max_length: int, min_length: int = 1,
                            sigma: float = 1.0, seed: int = 0) -> list[int]:
    """Document lengths with a realistic, heavy-tailed distribution: log-normal, rounded, clipped to a maximum.

    Why: the lengths of real documents (web pages, chat turns, code files) are roughly log-normal: most
    are short, a few are very long, and the longest of a batch sets how much a padded batch pays. Generated,
    so nothing is downloaded; the same seed gives the same lengths.

    Args:
        num_documents: how many lengths.
        mean_length: the mean of the log-normal before clipping (tokens).
        max_length: the longest allowed document (tokens): longer draws are cut to it, as a tokenizer's
            truncation does.
        min_length: the shortest allowed document (tokens; 2 gives every document a next-token target).
        sigma: the spread of the log-lengths (1.0: the longest of 32 documents is typically 5-10× the median).
        seed: seeds a private ``torch.Generator`` (the global random state is not touched).

    Returns:
        ``num_documents`` ints between ``min_length`` and ``max_length``.

    Raises:
        ValueError: a count or length that is not a positive int, ``min_length`` above ``max_length``, or a
            mean or sigma that is not a positive finite number.

    Example:
        >>> lengths = sample_document_lengths(32, mean_length=128, max_length=1024)
    """
    positive_int("num_documents", num_documents)
    positive_int("max_length", max_length, "tokens")
    positive_int("min_length", min_length, "tokens")
    if min_length > max_length:
        raise ValueError(f"min_length ({min_length}) must not exceed max_length ({max_length})")
    positive_number("mean_length", mean_length)
    positive_number("sigma", sigma)
    generator = torch.Generator().manual_seed(seed)
    mu = math.log(mean_length) - sigma**2 / 2         # so that the log-normal's mean is mean_length
    draws = torch.exp(mu + sigma * torch.randn(num_documents, generator=generator, dtype=torch.float64))
    return [int(n) for n in draws.round().clamp(min_length, max_length).tolist()]
