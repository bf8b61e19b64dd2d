"""An 8-bit blockwise AdamW in plain torch: both moments stored as uint8 codes with one fp32 scale per block.

Introduced in notebook 09 (fine-tuning memory). AdamW keeps two fp32 moments per parameter, 8 bytes;
this optimizer keeps each moment as one byte per element plus one fp32 scale per block of
``block_size`` elements, about 2 bytes per parameter in all (``2 + 8 / block_size``). It is the idea of
Dettmers et al., *8-bit Optimizers via Block-wise Quantization* (ICLR 2022), written for reading, not
for speed: bitsandbytes (``bnb.optim.AdamW8bit``) and torchao (``torchao.optim.AdamW8bit``) are the
production versions, with fused kernels. Neither is installed here.

How a moment is stored (``quantize_blockwise``): the flattened tensor is cut into blocks of
``block_size`` elements; each block is divided by its largest absolute value (the block's fp32 scale),
so every element lands in [-1, 1]; each element is then replaced by the index (0..255) of the nearest
value in a fixed 256-entry codebook. The codebooks are logarithmic, like the "dynamic" maps of
bitsandbytes: most codes sit near zero, where Adam's moments are, so a small element in a block with
a large one keeps a few percent of relative precision instead of rounding to zero. The second moment's
codebook has no zero: an element too small for it is read back as the smallest code, which makes its
update smaller, never a division by ``eps``.

In ``step()`` each parameter's moments are dequantised to fp32 temporaries, updated exactly as
``torch.optim.AdamW`` does, used for the update, and quantised back in place into the stored codes.
"""

from __future__ import annotations

import math
from typing import Any, Callable, Iterable

import torch

from .checks import positive_int

# m (signed): zero and ±127 log-spaced magnitudes from 1e-4 to 1; v (non-negative): 256 log-spaced
# values from 1e-8 to 1, no zero (a v read back as zero would divide the update by eps alone)
_SIGNED_SMALLEST = 1e-4
_UNSIGNED_SMALLEST = 1e-8


def signed_codebook(device: torch.device | str = "cpu") -> torch.Tensor:
    """The 255 sorted fp32 values a signed code (Adam's first moment, over its block scale) can take.

    Why log-spaced: Adam's moments span orders of magnitude inside one block, and evenly spaced codes
    would round every element much smaller than the block's largest to zero. Here: zero, and 127
    magnitudes spaced evenly in log scale from 1e-4 to 1, with both signs; neighbouring magnitudes
    differ by about 7.6 %, so rounding to the nearest keeps about 4 % of relative precision.

    Args:
        device: where to build the codebook.

    Returns:
        A sorted fp32 tensor of 255 values in [-1, 1], zero included.

    Example:
        >>> signed_codebook()[[0, 127, 254]]
        tensor([-1.,  0.,  1.])
    """
    magnitudes = torch.logspace(math.log10(_SIGNED_SMALLEST), 0.0, 127, dtype=torch.float64)
    values = torch.cat([-magnitudes.flip(0), torch.zeros(1, dtype=torch.float64), magnitudes])
    return values.to(device=device, dtype=torch.float32)


def unsigned_codebook(device: torch.device | str = "cpu") -> torch.Tensor:
    """The 256 sorted fp32 values an unsigned code (Adam's second moment, over its block scale) can take.

    256 values spaced evenly in log scale from 1e-8 to 1 (about 7.5 % apart). No zero, on purpose: a
    second moment read back as zero would divide its update by ``eps`` alone; the smallest code makes
    the update of a tiny element smaller instead.

    Args:
        device: where to build the codebook.

    Returns:
        A sorted fp32 tensor of 256 positive values, the largest 1.

    Example:
        >>> round(float(unsigned_codebook()[0]), 12)
        1e-08
    """
    values = torch.logspace(math.log10(_UNSIGNED_SMALLEST), 0.0, 256, dtype=torch.float64)
    return values.to(device=device, dtype=torch.float32)


def num_blocks(numel: int, block_size: int) -> int:
    """Blocks (and so fp32 scales) a tensor of ``numel`` elements needs: ``ceil(numel / block_size)``.

    Args:
        numel: elements of the tensor (>= 0).
        block_size: elements per block (> 0).

    Raises:
        ValueError: a block size that is not a positive int.

    Example:
        >>> num_blocks(1000, 256)
        4
    """
    positive_int("block_size", block_size, "elements per block")
    return math.ceil(numel / block_size)


def quantize_blockwise(x: torch.Tensor, codebook: torch.Tensor, block_size: int, *,
                       out_codes: torch.Tensor | None = None,
                       out_scales: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Store ``x`` as uint8 codebook indices plus one fp32 scale (absolute maximum) per block.

    Args:
        x: the tensor to store (any shape; float).
        codebook: sorted fp32 values in [-1, 1] (``signed_codebook`` or ``unsigned_codebook``).
        block_size: elements per block (> 0); the last block may be shorter.
        out_codes, out_scales: existing tensors to write into (shape of ``x``, uint8; and
            ``(num_blocks,)``, fp32), so that the stored state is never reallocated.

    Returns:
        ``(codes, scales)``: uint8 codes with the shape of ``x`` and fp32 scales of shape
        ``(ceil(x.numel() / block_size),)``.

    Raises:
        ValueError: a block size that is not a positive int.

    Example:
        >>> codes, scales = quantize_blockwise(torch.randn(1000), signed_codebook(), 256)
        >>> codes.dtype, scales.shape
        (torch.uint8, torch.Size([4]))
    """
    positive_int("block_size", block_size, "elements per block")
    flat = x.detach().reshape(-1).float()
    n = flat.numel()
    blocks = num_blocks(n, block_size)
    padded = torch.nn.functional.pad(flat, (0, blocks * block_size - n)).view(blocks, block_size)  # (blocks, size)
    scales = padded.abs().amax(dim=1)                                         # (blocks,)
    normalized = padded / scales.clamp(min=torch.finfo(torch.float32).tiny)[:, None]
    midpoints = (codebook[1:] + codebook[:-1]) / 2                            # nearest code = bucket of midpoints
    codes = torch.bucketize(normalized, midpoints).to(torch.uint8).view(-1)[:n]
    if out_codes is None:
        out_codes = torch.empty(x.shape, dtype=torch.uint8, device=x.device)
    if out_scales is None:
        out_scales = torch.empty(blocks, dtype=torch.float32, device=x.device)
    out_codes.view(-1).copy_(codes)    # a copy: the padded codes' storage is longer than the tensor
    out_scales.copy_(scales)
    return out_codes, out_scales


def dequantize_blockwise(codes: torch.Tensor, scales: torch.Tensor, codebook: torch.Tensor,
                         block_size: int) -> torch.Tensor:
    """The fp32 tensor that ``quantize_blockwise`` stored: ``codebook[code] * scale of its block``.

    Args:
        codes: uint8 codes (any shape).
        scales: fp32 scales, one per block of ``block_size`` elements of the flattened codes.
        codebook: the codebook the codes index.
        block_size: elements per block (> 0).

    Returns:
        A new fp32 tensor with the shape of ``codes``.

    Raises:
        ValueError: a block size that is not a positive int.

    Example:
        >>> codes, scales = quantize_blockwise(torch.tensor([0.5, -1.0]), signed_codebook(), 256)
        >>> dequantize_blockwise(codes, scales, signed_codebook(), 256)
        tensor([ 0.5179, -1.0000])
    """
    positive_int("block_size", block_size, "elements per block")
    n = codes.numel()
    values = codebook[codes.reshape(-1).long()]                               # (n,) in [-1, 1]
    per_element_scale = scales.repeat_interleave(block_size)[:n]              # (n,)
    return (values * per_element_scale).view(codes.shape)


class AdamW8bit(torch.optim.Optimizer):
    """AdamW whose two moments are stored in 8 bits, blockwise (about 2 bytes per parameter, not 8).

    Why: AdamW's fp32 moments are 8 of the 16 bytes per parameter of fp32 training (notebook 01).
    Stored as uint8 codes with one fp32 scale per block they take ``2 + 8 / block_size`` bytes per
    parameter; the update itself is computed in fp32, exactly as ``torch.optim.AdamW`` computes it,
    from the dequantised moments.

    State per parameter (what ``utils.predict_optimizer_state_bytes(..., "adamw8bit")`` counts):
    ``exp_avg_codes`` and ``exp_avg_sq_codes`` (uint8, the parameter's shape), ``exp_avg_scales`` and
    ``exp_avg_sq_scales`` (fp32, ``ceil(numel / block_size)`` each), and ``step`` (a Python int, no
    tensor). Every parameter is quantised, small ones too (bitsandbytes keeps tensors under 4096
    elements in 32 bits by default).

    Args:
        params: parameters or parameter groups, as for any ``torch.optim`` optimizer.
        lr: learning rate (> 0).
        betas: decay rates of the two moments, each in [0, 1).
        eps: added to the denominator (> 0).
        weight_decay: decoupled weight decay, as in ``torch.optim.AdamW`` (>= 0; default 0.01).
        block_size: elements per quantisation block (> 0; default 256, torchao's default).

    Raises:
        ValueError: a learning rate, beta, eps, weight decay or block size out of range.

    Example:
        >>> optimizer = AdamW8bit(model.parameters(), lr=1e-3)
        >>> loss.backward(); optimizer.step(); optimizer.zero_grad()

    Known limitations:
        Slower than fused AdamW (several plain torch ops per parameter and a codebook search);
        no sparse gradients, no complex parameters, no ``amsgrad``. Parameters in bf16 or fp16 are
        updated through an fp32 copy of the parameter.
    """

    def __init__(self, params: Iterable[Any], lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-8, weight_decay: float = 1e-2, block_size: int = 256) -> None:
        if isinstance(lr, bool) or not isinstance(lr, (int, float)) or not lr > 0 or not math.isfinite(lr):
            raise ValueError(f"lr must be a finite number > 0, got {lr!r}")
        if (not isinstance(betas, (tuple, list)) or len(betas) != 2
                or not all(isinstance(b, (int, float)) and 0.0 <= b < 1.0 for b in betas)):
            raise ValueError(f"betas must be two numbers in [0, 1), got {betas!r}")
        if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not eps > 0:
            raise ValueError(f"eps must be a number > 0, got {eps!r}")
        if isinstance(weight_decay, bool) or not isinstance(weight_decay, (int, float)) or weight_decay < 0:
            raise ValueError(f"weight_decay must be a number >= 0, got {weight_decay!r}")
        positive_int("block_size", block_size, "elements per quantisation block")
        defaults = dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay, block_size=block_size)
        super().__init__(params, defaults)
        # the codebooks live on the optimizer, not in its state: made here, before any measured step
        self._codebooks: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}
        for group in self.param_groups:
            for param in group["params"]:
                self._codebooks_on(param.device)

    def _codebooks_on(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        if device not in self._codebooks:
            self._codebooks[device] = (signed_codebook(device), unsigned_codebook(device))
        return self._codebooks[device]

    def _init_state(self, param: torch.Tensor, block_size: int) -> dict[str, Any]:
        blocks = num_blocks(param.numel(), block_size)
        # all scales 0: every moment reads back as exactly 0, whatever the codes say
        return {"step": 0,
                "exp_avg_codes": torch.zeros(param.shape, dtype=torch.uint8, device=param.device),
                "exp_avg_scales": torch.zeros(blocks, dtype=torch.float32, device=param.device),
                "exp_avg_sq_codes": torch.zeros(param.shape, dtype=torch.uint8, device=param.device),
                "exp_avg_sq_scales": torch.zeros(blocks, dtype=torch.float32, device=param.device)}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a state saved by ``state_dict()``, keeping the codes uint8 and the scales fp32.

        ``torch.optim.Optimizer.load_state_dict`` casts every saved tensor to its parameter's
        floating dtype (right for AdamW's moments, wrong for 8-bit codes): this puts the saved
        tensors back as they were saved, on their parameter's device.
        """
        super().load_state_dict(state_dict)
        saved = state_dict["state"]
        for group, saved_group in zip(self.param_groups, state_dict["param_groups"]):
            for param, param_id in zip(group["params"], saved_group["params"]):
                for key, value in saved.get(param_id, {}).items():
                    if isinstance(value, torch.Tensor):
                        self.state[param][key] = value.to(device=param.device, copy=True)

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        """One AdamW update of every parameter that has a gradient.

        Args:
            closure: re-evaluates the model and returns the loss (optional, as in ``torch.optim``).

        Returns:
            The closure's loss, or None.
        """
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            lr, eps, block_size = group["lr"], group["eps"], group["block_size"]
            for param in group["params"]:
                if param.grad is None:
                    continue
                if param.grad.is_sparse or param.is_complex():
                    raise RuntimeError("AdamW8bit supports dense real parameters only")
                state = self.state[param]
                if not state:
                    state.update(self._init_state(param, block_size))
                self._update(param, state, beta1, beta2, lr, eps, group["weight_decay"], block_size)
        return loss

    def _update(self, param: torch.Tensor, state: dict[str, Any], beta1: float, beta2: float, lr: float,
                eps: float, weight_decay: float, block_size: int) -> None:
        signed, unsigned = self._codebooks_on(param.device)
        state["step"] += 1
        step = state["step"]
        grad = param.grad.float()
        exp_avg = dequantize_blockwise(state["exp_avg_codes"], state["exp_avg_scales"], signed, block_size)
        exp_avg_sq = dequantize_blockwise(state["exp_avg_sq_codes"], state["exp_avg_sq_scales"], unsigned, block_size)
        exp_avg.lerp_(grad, 1 - beta1)                                        # m = b1 m + (1 - b1) g
        exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)          # v = b2 v + (1 - b2) g²
        weights = param if param.dtype == torch.float32 else param.float()
        weights.mul_(1 - lr * weight_decay)                                   # decoupled weight decay
        denominator = (exp_avg_sq / (1 - beta2 ** step)).sqrt_().add_(eps)
        weights.addcdiv_(exp_avg, denominator, value=-lr / (1 - beta1 ** step))
        if weights is not param:
            param.copy_(weights)
        quantize_blockwise(exp_avg, signed, block_size,
                           out_codes=state["exp_avg_codes"], out_scales=state["exp_avg_scales"])
        quantize_blockwise(exp_avg_sq, unsigned, block_size,
                           out_codes=state["exp_avg_sq_codes"], out_scales=state["exp_avg_sq_scales"])


# --- notebook 10 (fewer bits): the formulas behind its predictions --------------------------------------

#: bitsandbytes' NF4 table (``bitsandbytes.functional``, the 16 values its 4-bit kernels index), kept here
#: only to cross-check notebook 10's own construction of the levels; bitsandbytes is not installed.
NF4_BITSANDBYTES = (-1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453, -0.28444138169288635,
                    -0.18477343022823334, -0.09105003625154495, 0.0, 0.07958029955625534, 0.16093020141124725,
                    0.24611230194568634, 0.33791524171829224, 0.44070982933044434, 0.5626170039176941,
                    0.7229568362236023, 1.0)

#: the float formats notebook 10 compares, by name: (torch dtype, exponent bits, mantissa bits)
FORMATS: dict[str, tuple[torch.dtype, int, int]] = {
    "fp32": (torch.float32, 8, 23), "bf16": (torch.bfloat16, 8, 7), "fp16": (torch.float16, 5, 10),
    "e4m3": (torch.float8_e4m3fn, 4, 3), "e5m2": (torch.float8_e5m2, 5, 2)}

#: what ``training_state_bytes`` knows how to count (see its docstring)
METHODS = ("full", "lora", "qlora", "qlora-prepared", "bf16-sr", "bf16-kahan", "fp8")


def float_format(name: str) -> dict[str, Any]:
    """A float format's range and precision, derived from its bit layout (not read from ``torch.finfo``).

    Why: FP8 comes in two layouts with very different trade-offs (e4m3: more precision, max 448; e5m2: more
    range, max 57344); their figures follow from the bits, which is what notebook 10 checks against torch.

    Args:
        name: one of ``FORMATS`` ("fp32", "bf16", "fp16", "e4m3", "e5m2").

    Returns:
        ``{"dtype", "bits", "max", "smallest_normal", "eps"}``: ``eps`` is the gap between 1 and the next
        value (relative rounding error at most ``eps / 2``). e4m3 is the "fn" variant (no infinities; its
        all-ones pattern is NaN, so its largest mantissa at the top exponent is 110: 1.75 · 2⁸ = 448).

    Raises:
        ValueError: an unknown format name (the message lists the known ones).

    Example:
        >>> float_format("e4m3")["max"]
        448.0
    """
    if name not in FORMATS:
        raise ValueError(f"unknown format {name!r}: expected one of {sorted(FORMATS)}")
    dtype, exponent_bits, mantissa_bits = FORMATS[name]
    bias = 2 ** (exponent_bits - 1) - 1
    if name == "e4m3":          # no inf: the top exponent is an ordinary one, minus the NaN pattern
        largest = (2 - 2 * 2.0 ** -mantissa_bits) * 2.0 ** (2 ** exponent_bits - 1 - bias)
    else:                       # IEEE-like: the top exponent is inf/NaN
        largest = (2 - 2.0 ** -mantissa_bits) * 2.0 ** (2 ** exponent_bits - 2 - bias)
    return {"dtype": dtype, "bits": 1 + exponent_bits + mantissa_bits, "max": largest,
            "smallest_normal": 2.0 ** (1 - bias), "eps": 2.0 ** -mantissa_bits}


def nf4_storage_bytes(numel: int, block_size: int = 64, double_quant: bool = True,
                      scale_block_size: int = 256) -> int:
    """Bytes a weight of ``numel`` elements takes in NF4 as notebook 10 stores it.

    Two 4-bit codes per byte, plus the scales: one fp32 absmax per block of ``block_size`` elements, or,
    with double quantisation, those scales stored as int8 codes (1 byte each) with one fp32 absmax per
    ``scale_block_size`` of them and one fp32 offset (their mean) per weight.

    Args:
        numel: elements of the weight (> 0, a multiple of ``block_size``).
        block_size: elements per NF4 block (even, > 0; QLoRA's 64).
        double_quant: quantise the scales too (QLoRA's double quantisation).
        scale_block_size: scales per block of the second quantisation (> 0; QLoRA's 256).

    Returns:
        Bytes (an int): ``numel / 2 + 4 · numel / block_size`` without double quantisation,
        ``numel / 2 + blocks + 4 · ceil(blocks / scale_block_size) + 4`` with it.

    Raises:
        ValueError: a block size that is not a positive even int dividing ``numel``.

    Example:
        >>> nf4_storage_bytes(4096 * 4096) / (4096 * 4096)    # about 4.127 bits per parameter
        0.5158...
    """
    positive_int("numel", numel, "elements")
    positive_int("block_size", block_size, "elements per block")
    positive_int("scale_block_size", scale_block_size, "scales per block")
    if block_size % 2 or numel % block_size:
        raise ValueError(f"block_size must be an even number of elements that divides the weight's {numel}, "
                         f"got {block_size}")
    blocks = numel // block_size
    scales = blocks + 4 * math.ceil(blocks / scale_block_size) + 4 if double_quant else 4 * blocks
    return numel // 2 + scales


def lora_parameters(linear_shapes: Iterable[tuple[int, int]], rank: int) -> int:
    """Elements of LoRA's adapters on Linear layers of shapes ``(out, in)``: ``rank · (in + out)`` each."""
    positive_int("rank", rank)
    return sum(rank * (in_features + out_features) for out_features, in_features in linear_shapes)


def training_state_bytes(method: str, linear_shapes: Iterable[tuple[int, int]], other_parameters: int, *,
                         lora_rank: int = 16, block_size: int = 64, double_quant: bool = True) -> int:
    """Model state (weights, gradients, optimizer state) of one training set-up, from the shapes alone.

    The model is described by the Linear layers that LoRA adapts and NF4 quantises (``(out, in)`` each) and
    the number of its other parameters (embeddings, norms, biases, the head). AdamW throughout; its step
    counters are not counted (torch keeps one 4-byte tensor per parameter tensor; add them when comparing
    with a measurement). Activations are not included.

    Methods:
        ``"full"``: every parameter trains in fp32 with AdamW, or in mixed precision with fp32 master
        weights: 16 bytes each. ``"lora"``: a bf16 frozen base (2 bytes each) and fp32 adapters with their
        gradients and AdamW (16 bytes per adapter parameter). ``"qlora"``: the Linear layers in NF4
        (``nf4_storage_bytes``), the rest bf16, the same adapters. ``"qlora-prepared"``: as ``"qlora"`` after
        peft's ``prepare_model_for_kbit_training``, which casts every non-4-bit bf16/fp16 parameter to fp32
        (4 bytes each). ``"bf16-sr"``: pure bf16 training, weights, gradients and both moments in bf16
        (8 bytes each; stochastic rounding needs no extra state). ``"bf16-kahan"``: the same plus a bf16
        Kahan compensation buffer (10). ``"fp8"``: dynamic FP8 training keeps the full set-up's 16 bytes (the
        FP8 copies of a layer's weight, 1 byte per parameter, live only while its matmul runs).

    Args:
        method: one of ``METHODS``.
        linear_shapes: ``(out_features, in_features)`` of each Linear layer LoRA would adapt.
        other_parameters: elements of every other parameter (>= 0).
        lora_rank: LoRA's rank (> 0), for the LoRA methods.
        block_size, double_quant: NF4's settings, for the QLoRA methods.

    Returns:
        Bytes (an int).

    Raises:
        ValueError: an unknown method (the message lists them), a bad rank or block size.

    Example:
        >>> training_state_bytes("bf16-sr", [(8, 8)], 16)
        640
    """
    if method not in METHODS:
        raise ValueError(f"unknown method {method!r}: expected one of {METHODS}")
    shapes = [tuple(shape) for shape in linear_shapes]
    linear = sum(out_features * in_features for out_features, in_features in shapes)
    if isinstance(other_parameters, bool) or not isinstance(other_parameters, int) or other_parameters < 0:
        raise ValueError(f"other_parameters must be an int >= 0 (elements), got {other_parameters!r}")
    total = linear + other_parameters
    if method in ("full", "fp8"):
        return 16 * total
    if method in ("bf16-sr", "bf16-kahan"):
        return (8 if method == "bf16-sr" else 10) * total
    adapters = 16 * lora_parameters(shapes, lora_rank)
    if method == "lora":
        return 2 * total + adapters
    base = sum(nf4_storage_bytes(o * i, block_size, double_quant) for o, i in shapes)
    return base + (2 if method == "qlora" else 4) * other_parameters + adapters


def llama_shapes(num_layers: int, d_model: int, ffn_width: int, vocab_size: int, num_heads: int,
                 num_kv_heads: int | None = None, tie_embeddings: bool = False) -> tuple[list[tuple[int, int]], int]:
    """A Llama's Linear layers ``(out, in)`` (q, k, v, o, gate, up, down per block) and its other parameters.

    The other parameters: the token embedding, the output head (unless tied), two RMSNorm weights per block
    and the final norm. Llama 2 7B (32, 4096, 11008, 32000, 32) has 6,738,415,616 parameters, 70B (80, 8192,
    28672, 32000, 64, 8 key/value heads) 68,976,648,192: the published counts.

    Returns:
        ``(linear_shapes, other_parameters)``, as ``training_state_bytes`` takes them.
    """
    for name, value in [("num_layers", num_layers), ("d_model", d_model), ("ffn_width", ffn_width),
                        ("vocab_size", vocab_size), ("num_heads", num_heads)]:
        positive_int(name, value)
    num_kv_heads = num_heads if num_kv_heads is None else positive_int("num_kv_heads", num_kv_heads)
    if d_model % num_heads or num_heads % num_kv_heads:
        raise ValueError(f"d_model ({d_model}) must divide by num_heads ({num_heads}), and num_heads by "
                         f"num_kv_heads ({num_kv_heads})")
    kv_width = d_model // num_heads * num_kv_heads
    block = [(d_model, d_model), (kv_width, d_model), (kv_width, d_model), (d_model, d_model),
             (ffn_width, d_model), (ffn_width, d_model), (d_model, ffn_width)]
    other = vocab_size * d_model * (1 if tie_embeddings else 2) + (2 * num_layers + 1) * d_model
    return block * num_layers, other


# --- notebook 10's pure-bf16 AdamW, as an optimizer: what the calculator's "stochastic" and "kahan" replay ----

#: how ``AdamWBF16`` writes each update back into a bf16 weight
BF16_ROUNDINGS = ("nearest", "stochastic", "kahan")


def round_stochastic(x: torch.Tensor) -> torch.Tensor:
    """fp32 -> bf16, rounding up with probability (x - lower) / gap: unbiased on average (notebook 10's recipe)."""
    bits = x.float().contiguous().view(torch.int32)                # bf16 is the top 16 bits of an fp32
    noise = torch.randint_like(bits, 0, 1 << 16)                  # uniform over the 16 bits bf16 drops
    return ((bits + noise) & -65536).view(torch.float32).to(torch.bfloat16)   # exact: the low bits are now 0


def add_kahan_(weight: torch.Tensor, update: torch.Tensor, compensation: torch.Tensor) -> None:
    """weight += update in bf16, keeping what rounding drops in ``compensation`` (bf16) for the next call."""
    exact = weight.float() + (update.float() + compensation.float())
    weight.copy_(exact)                                             # rounds to the nearest bf16
    compensation.copy_(exact - weight.float())                      # the part that was rounded away


class AdamWBF16(torch.optim.Optimizer):
    """AdamW on bf16 weights with bf16 moments: 8 bytes per parameter with its gradient (10 with Kahan).

    Notebook 10's ``adamw_bf16_step`` as a ``torch.optim.Optimizer``, so that the calculator's pure-bf16 options
    (``TrainingSetup(precision="bf16", bf16_rounding="stochastic" | "kahan")``) can be measured step by step
    (``tests/test_calculator_lowbit.py``). Each parameter's moments ``m`` and ``v`` are bf16 tensors of its
    shape (plus a bf16 Kahan buffer ``c``); the step count is a Python int, so no tensor. The update is computed
    in fp32 temporaries, one parameter at a time, and written back rounded stochastically
    (``round_stochastic``), with Kahan summation (``add_kahan_``) or to the nearest bf16.

    Args:
        params: parameters or groups (bf16).
        lr: learning rate (> 0).
        betas: decay rates of the moments, each in [0, 1).
        eps: added to the denominator (> 0).
        weight_decay: decoupled weight decay (>= 0; default 0, as notebook 10).
        rounding: one of ``BF16_ROUNDINGS``.

    Raises:
        ValueError: an unknown rounding (the message lists them), a learning rate out of range.
        TypeError: in ``step()``, a parameter with a gradient that is not bf16 (its update would round it to bf16
            silently); checked before any parameter is updated.

    Example:
        >>> optimizer = AdamWBF16(model.to(torch.bfloat16).parameters(), lr=3e-4, rounding="stochastic")
    """

    def __init__(self, params: Iterable[Any], lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-8, weight_decay: float = 0.0, rounding: str = "stochastic") -> None:
        if rounding not in BF16_ROUNDINGS:
            raise ValueError(f"rounding must be one of {BF16_ROUNDINGS}, got {rounding!r}")
        if isinstance(lr, bool) or not isinstance(lr, (int, float)) or not lr > 0:
            raise ValueError(f"lr must be a number > 0, got {lr!r}")
        super().__init__(params, dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay))
        self.rounding = rounding

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        """One update of every parameter that has a gradient (notebook 10's loop, per parameter)."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        wrong = sorted({str(p.dtype) for group in self.param_groups for p in group["params"]
                        if p.grad is not None and p.dtype != torch.bfloat16})
        if wrong:                                                   # refused before any parameter is updated
            raise TypeError(f"AdamWBF16 expects torch.bfloat16 parameters and would round {wrong} ones to bf16: use "
                            "torch.optim.AdamW for them, or model.to(torch.bfloat16)")
        for group in self.param_groups:
            lr, betas, eps, weight_decay = group["lr"], group["betas"], group["eps"], group["weight_decay"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                s = self.state[p]
                if not s:
                    s.update({"step": 0, "m": torch.zeros_like(p), "v": torch.zeros_like(p)}
                             | ({"c": torch.zeros_like(p)} if self.rounding == "kahan" else {}))
                s["step"] = step = s["step"] + 1                    # a Python int: no tensor
                grad = p.grad.float()
                m = s["m"].float().lerp_(grad, 1 - betas[0])        # fp32 temporaries, stored back in bf16
                v = s["v"].float().mul_(betas[1]).addcmul_(grad, grad, value=1 - betas[1])
                s["m"].copy_(m), s["v"].copy_(v)
                update = -lr * (m / (1 - betas[0] ** step)) / ((v / (1 - betas[1] ** step)).sqrt() + eps)
                update -= lr * weight_decay * p.float()
                if self.rounding == "stochastic":
                    p.copy_(round_stochastic(p.float() + update))
                elif self.rounding == "kahan":
                    add_kahan_(p, update, s["c"])
                else:
                    p.copy_(p.float() + update)
        return loss
