"""The model's parameters, in ``model.parameters()`` order, as its family lays them out (LoRA's adapters included)."""

from __future__ import annotations

import math

from . import registry
from .config import ModelConfig, TrainingSetup


def parameter_shapes(model: ModelConfig, setup: TrainingSetup | None = None) -> list[tuple[str, tuple[int, ...], bool]]:
    """Every parameter as (name, shape, trainable), in the order ``model.parameters()`` yields them.

    With LoRA (``setup.lora_rank > 0``) the base weights are frozen and each targeted Linear gains its two
    adapters (the course's ``lora_a`` (rank, in) and ``lora_b`` (out, rank); peft's ``lora_A`` / ``lora_B``),
    trainable, where the family's module registers them.

    Example:
        >>> sum(math.prod(s) for _, s, _ in parameter_shapes(PRESETS["7B"]))
        6738415616
    """
    setup = setup or TrainingSetup()
    return registry.family_of(model.arch).parameter_shapes(model, setup)


def count_parameters(model: ModelConfig, setup: TrainingSetup | None = None, *, trainable_only: bool = False) -> int:
    """Parameter elements of a ``ModelConfig`` (its LoRA adapters included when ``setup`` has a rank).

    Unlike ``utils.count_parameters``, which counts a built ``nn.Module``, this counts from the shape alone,
    so a 70B model needs no memory: ``count_parameters(PRESETS["70B"]) == 68_976_648_192``, the published count.

    Args:
        model: the shape.
        setup: for LoRA's adapters and frozen weights (default: full fine-tuning).
        trainable_only: count only what trains (the adapters, under LoRA).

    Returns:
        Elements (an int).
    """
    return sum(math.prod(shape) for _, shape, trainable in parameter_shapes(model, setup)
               if trainable or not trainable_only)
