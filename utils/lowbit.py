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
