"""Predicting memory before measuring it: parameters, gradients, optimizer state, activations.

Introduced in notebook 01. These functions only count; ``utils.memory`` measures. Putting the two
side by side is how the course checks its model of memory.

Bytes per parameter (the ZeRO paper's accounting, Rajbhandari et al. 2020, section 3.1):

============  =======  =====  ===========  ==========  =====
precision     weights  grads  fp32 master  Adam m + v  total
============  =======  =====  ===========  ==========  =====
fp32             4       4         0           8        16
mixed (ZeRO)     2       2         4           8        16
mixed, fp32      2       4         4           8        18   (Hugging Face's "Model training
grads                                                          anatomy": 4+2 weights, 4 grads, 8)
============  =======  =====  ===========  ==========  =====

SGD keeps no state, SGD with momentum one fp32 buffer (4 bytes); Adam and AdamW two (8 bytes) plus
a 4-byte ``step`` tensor per parameter *tensor* (not per element), which the exact CPU tracker sees.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Iterable

import torch

OPTIMIZERS = ("sgd", "sgd_momentum", "adam", "adamw")
PRECISIONS = ("fp32", "mixed")
_STATE_BYTES = {"sgd": 0, "sgd_momentum": 4, "adam": 8, "adamw": 8}
_STEP_TENSOR_BYTES = {"sgd": 0, "sgd_momentum": 0, "adam": 4, "adamw": 4}


def _check_choice(name: str, value: str, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        raise ValueError(f"{name} must be one of {allowed}, got {value!r}")


@dataclass(frozen=True)
class BytesPerParameter:
    """Bytes that training keeps per parameter, by role.

    Attributes:
        weights: the copy the model computes with (4 in fp32, 2 in fp16/bf16).
        grads: the gradient.
        master: the fp32 master copy that mixed precision updates (0 in fp32).
        optimizer: optimizer state (momentum, Adam's two moments), kept in fp32.
    """

    weights: int
    grads: int
    master: int
    optimizer: int

    @property
    def total(self) -> int:
        """All bytes per parameter."""
        return self.weights + self.grads + self.master + self.optimizer


def bytes_per_parameter(optimizer: str = "adamw", precision: str = "fp32",
                        fp32_grads: bool = False) -> BytesPerParameter:
    """Bytes per parameter for weights, gradients, master copy and optimizer state.

    Args:
        optimizer: one of ``"sgd"``, ``"sgd_momentum"``, ``"adam"``, ``"adamw"``.
        precision: ``"fp32"``, or ``"mixed"`` (16-bit weights and gradients, fp32 master weights
            and fp32 optimizer state, as in ZeRO and Apex O2).
        fp32_grads: with ``"mixed"``, keep gradients in fp32 (4 bytes instead of 2), which is
            how Hugging Face's docs arrive at 18 bytes per parameter for AdamW.

    Returns:
        A ``BytesPerParameter``; ``.total`` is 16 for AdamW in fp32 and in ZeRO's mixed precision.
    """
    _check_choice("optimizer", optimizer, OPTIMIZERS)
    _check_choice("precision", precision, PRECISIONS)
    if fp32_grads and precision != "mixed":
        raise ValueError("fp32_grads only makes sense with precision='mixed'")
    state = _STATE_BYTES[optimizer]
    if precision == "fp32":
        return BytesPerParameter(weights=4, grads=4, master=0, optimizer=state)
    return BytesPerParameter(weights=2, grads=4 if fp32_grads else 2, master=4, optimizer=state)


def count_parameters(model: torch.nn.Module | Iterable[torch.Tensor], trainable_only: bool = True) -> int:
    """Number of parameter elements (trainable ones only, by default)."""
    return sum(p.numel() for p in _parameters(model) if p.requires_grad or not trainable_only)


def _parameters(model: torch.nn.Module | Iterable[torch.Tensor]) -> list[torch.Tensor]:
    if isinstance(model, torch.nn.Module):
        return list(model.parameters())
    if isinstance(model, torch.Tensor):
        return [model]
    try:
        params = list(model)
    except TypeError:
        raise TypeError(f"expected an nn.Module or an iterable of tensors, not {type(model).__name__}") from None
    if not all(isinstance(p, torch.Tensor) for p in params):
        raise TypeError("expected an nn.Module or an iterable of tensors; found a non-tensor item")
    return params


@dataclass(frozen=True)
class ModelStateFootprint:
    """Predicted bytes of the model state that training keeps alive between steps.

    Attributes:
        num_parameters: trainable parameter elements.
        num_tensors: trainable parameter tensors (Adam keeps one 4-byte step tensor each).
        params_bytes, grads_bytes, master_bytes, optimizer_bytes: bytes by role.
    """

    num_parameters: int
    num_tensors: int
    params_bytes: int
    grads_bytes: int
    master_bytes: int
    optimizer_bytes: int

    @property
    def total_bytes(self) -> int:
        """All model-state bytes."""
        return self.params_bytes + self.grads_bytes + self.master_bytes + self.optimizer_bytes


def predict_model_state(model: torch.nn.Module | Iterable[torch.Tensor], optimizer: str = "adamw",
                        precision: str = "fp32", fp32_grads: bool = False) -> ModelStateFootprint:
    """Predict parameter, gradient, master-copy and optimizer-state bytes of a model.

    Args:
        model: an ``nn.Module`` or an iterable of parameter tensors (trainable ones count).
        optimizer, precision, fp32_grads: as in ``bytes_per_parameter``.

    Returns:
        A ``ModelStateFootprint``. In fp32 on the CPU, the exact tracker of ``utils.memory``
        measures the same figures to the byte (notebook 01 asserts it).

    Example:
        >>> predict_model_state(torch.nn.Linear(10, 10), "adamw").optimizer_bytes
        888
    """
    params = [p for p in _parameters(model) if p.requires_grad]
    per = bytes_per_parameter(optimizer, precision, fp32_grads)
    numel = sum(p.numel() for p in params)
    return ModelStateFootprint(
        num_parameters=numel,
        num_tensors=len(params),
        params_bytes=per.weights * numel,
        grads_bytes=per.grads * numel,
        master_bytes=per.master * numel,
        optimizer_bytes=per.optimizer * numel + _STEP_TENSOR_BYTES[optimizer] * len(params),
    )


def max_trainable_parameters(memory_bytes: int, optimizer: str = "adamw", precision: str = "fp32",
                             fp32_grads: bool = False, activation_fraction: float = 0.0) -> int:
    """How many parameters fit for training in a memory budget, model state only.

    Args:
        memory_bytes: the device's memory (e.g. ``80 * 10**9`` for an "80 GB" GPU).
        optimizer, precision, fp32_grads: as in ``bytes_per_parameter``.
        activation_fraction: the share of memory set aside for activations, CUDA context and
            fragmentation, in [0, 1).

    Returns:
        The largest parameter count whose weights, gradients and optimizer state fit.
    """
    if memory_bytes <= 0:
        raise ValueError(f"memory_bytes must be positive, got {memory_bytes}")
    if not 0.0 <= activation_fraction < 1.0:
        raise ValueError(f"activation_fraction must be in [0, 1), got {activation_fraction}")
    per = bytes_per_parameter(optimizer, precision, fp32_grads)
    return int(memory_bytes * (1.0 - activation_fraction)) // per.total


def predict_mlp_activation_bytes(model: torch.nn.Module, batch_size: int,
                                 dtype: torch.dtype = torch.float32) -> int:
    """Predict the bytes a ``utils.MLP`` keeps alive after its forward pass, for backward.

    Each hidden layer keeps one (batch, hidden) tensor: ReLU saves its output for backward, and
    that same tensor is the next Linear's saved input, so it is stored once. The pre-activation
    (the Linear's output) is freed as soon as ReLU has run. The final output (batch, out) is alive
    too. The input batch itself existed before the forward pass and is not counted.

    Args:
        model: a ``utils.MLP`` without dropout.
        batch_size: rows in the batch.
        dtype: the activations' dtype.

    Returns:
        Predicted bytes of activations plus output.
    """
    from .models import MLP  # local import: models imports nothing from here

    if not isinstance(model, MLP):
        raise TypeError(f"expected a utils.MLP, got {type(model).__name__}")
    if model.dropout > 0:
        raise ValueError("the prediction assumes no dropout (dropout also saves a mask per layer)")
    if batch_size <= 0:
        raise ValueError(f"batch_size must be positive, got {batch_size}")
    item = torch.empty((), dtype=dtype).element_size()
    hidden = sum(model.hidden_features for _ in range(model.num_hidden_layers))
    return item * batch_size * (hidden + model.out_features)


STATE_OPTIMIZERS = ("sgd", "sgd_momentum", "adam", "adamw", "adafactor", "adamw8bit")


def _shape_numel(shape: object) -> tuple[int, ...]:
    if isinstance(shape, torch.Tensor):
        shape = shape.shape
    try:
        dims = tuple(shape)  # type: ignore[arg-type]
    except TypeError:
        raise TypeError(f"each shape must be a sequence of ints (or a tensor), got {shape!r}") from None
    if not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in dims):
        raise ValueError(f"each shape must hold ints >= 0, got {shape!r}")
    return dims


def predict_optimizer_state_bytes(shapes: Iterable[object], optimizer: str, *, block_size: int = 256) -> int:
    """Exact bytes of optimizer state for trainable parameters of the given shapes (fp32 state).

    Why: the optimizer's share is the part of fine-tuning memory that depends only on which
    parameters train and which optimizer trains them; this counts it tensor by tensor, the way
    ``torch.optim`` allocates it after the first ``step()``, so the exact CPU tracker agrees to
    the byte.

    What each optimizer keeps, per parameter tensor of ``n`` elements (4-byte fp32 elements):

    * ``"sgd"``: nothing.
    * ``"sgd_momentum"``: one ``momentum_buffer`` of ``n`` elements.
    * ``"adam"``, ``"adamw"``: ``exp_avg`` and ``exp_avg_sq`` (``2n`` elements) and a 0-dim fp32
      ``step`` tensor (4 bytes per tensor, not per element).
    * ``"adafactor"`` (``torch.optim.Adafactor``): a 0-dim fp32 ``step`` tensor; for a tensor of
      two or more dimensions a ``row_var`` of shape ``shape[:-1] + (1,)`` and a ``col_var`` of shape
      ``shape[:-2] + (1, shape[-1])`` (the factored second moment, no first moment); for a vector
      or a scalar a full ``variance`` of ``n`` elements.
    * ``"adamw8bit"`` (``utils.AdamW8bit``): both moments as uint8 codes (``2n`` bytes) and one
      fp32 scale per block of ``block_size`` elements for each moment (``2 * 4 * ceil(n /
      block_size)`` bytes); its step count is a Python int (no tensor).

    Args:
        shapes: the shapes of the trainable parameters (tuples, ``torch.Size``, or tensors whose
            ``.shape`` is used).
        optimizer: one of ``STATE_OPTIMIZERS``.
        block_size: elements per quantisation block (``"adamw8bit"`` only), > 0.

    Returns:
        Bytes of optimizer state (an int). Parameters in fp16/bf16 trained *without* fp32 master
        weights would keep torch's state in their own dtype; this assumes fp32 state, as with fp32
        parameters or mixed precision's fp32 master copy.

    Raises:
        ValueError: an unknown optimizer name (the message lists the known ones), a non-positive
            ``block_size``, or a shape with negative or non-int dimensions.
        TypeError: a shape that is not a sequence.

    Example:
        >>> predict_optimizer_state_bytes([(10, 10), (10,)], "adamw")
        888
        >>> predict_optimizer_state_bytes([(10, 10), (10,)], "adafactor")
        128

    Introduced in notebook 09 (fine-tuning memory).
    """
    if optimizer not in STATE_OPTIMIZERS:
        raise ValueError(f"optimizer must be one of {STATE_OPTIMIZERS}, got {optimizer!r}")
    if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size <= 0:
        raise ValueError(f"block_size must be a positive int (elements per block), got {block_size!r}")
    if isinstance(shapes, torch.Tensor):
        raise TypeError("shapes must be an iterable of shapes; wrap a single shape in a list")
    total = 0
    for shape in shapes:
        dims = _shape_numel(shape)
        numel = math.prod(dims)
        if optimizer == "sgd_momentum":
            total += 4 * numel
        elif optimizer in ("adam", "adamw"):
            total += 8 * numel + 4
        elif optimizer == "adafactor":
            if len(dims) > 1:
                rows = math.prod(dims[:-1])  # row_var: shape[:-1] + (1,)
                cols = math.prod(dims[:-2]) * dims[-1]  # col_var: shape[:-2] + (1, shape[-1])
                total += 4 * (rows + cols) + 4
            else:
                total += 4 * numel + 4
        elif optimizer == "adamw8bit":
            total += 2 * numel + 2 * 4 * math.ceil(numel / block_size)
    return total
