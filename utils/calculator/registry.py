"""The families the calculator knows, registered by name: ``arch`` (a ``ModelConfig``'s) and transformers' ``model_type``.

Each family module (``families/*.py``) ends with ``register(TheFamily())``; ``families/__init__.py`` imports them
all, and the package imports ``families`` before anything that makes a ``ModelConfig``. The engine looks a family
up once (``family_of(model.arch)``) and from then on calls what it provides; it never asks which family it holds.
This module imports nothing of the package, so that ``config.py`` (which every family imports) may use it.
"""

from __future__ import annotations

from typing import Any

_BY_ARCH: dict[str, Any] = {}          # ModelConfig.arch -> the family object
_BY_MODEL_TYPE: dict[str, Any] = {}    # transformers' model_type -> the family object


def register(family: Any) -> Any:
    """Make ``family`` known by its ``arch`` and every transformers ``model_type`` it reads; returns it.

    Raises:
        ValueError: an ``arch`` or ``model_type`` another family holds already.
    """
    if family.arch in _BY_ARCH:
        raise ValueError(f"arch {family.arch!r} is registered twice: expected one family module per design")
    for model_type in family.model_types:
        if model_type in _BY_MODEL_TYPE:
            raise ValueError(f"model_type {model_type!r} is read by {_BY_MODEL_TYPE[model_type].arch!r} already")
    _BY_ARCH[family.arch] = family
    for model_type in family.model_types:
        _BY_MODEL_TYPE[model_type] = family
    return family


def family_of(arch: str) -> Any:
    """The family of a ``ModelConfig.arch``.

    Raises:
        ValueError: an arch no family registered (the message lists the known ones).
    """
    family = _BY_ARCH.get(arch)
    if family is None:
        raise ValueError(f"arch must be one of {arches()}, got {arch!r}")
    return family


def family_for_model_type(model_type: Any) -> Any:
    """The family that reads transformers' ``model_type``.

    Raises:
        ValueError: a model_type no family reads (the message lists the supported ones).
    """
    family = _BY_MODEL_TYPE.get(model_type)
    if family is None:
        hint = _UNSUPPORTED_HINTS.get(model_type, "")
        raise ValueError(f"model_type {model_type!r} is not modelled: expected one of {model_types()}{hint}")
    return family


def arches(*, transformers: bool | None = None) -> tuple[str, ...]:
    """Registered arches (only transformers' families, or only the course's own designs, when asked)."""
    return tuple(arch for arch, family in _BY_ARCH.items()
                 if transformers is None or bool(family.model_types) == transformers)


def model_types() -> list[str]:
    """Every transformers ``model_type`` a family reads, sorted."""
    return sorted(_BY_MODEL_TYPE)


def families() -> tuple[Any, ...]:
    """Every registered family object, in registration order."""
    return tuple(_BY_ARCH.values())


# model_types readers bring that no family reads, with what to do instead
_UNSUPPORTED_HINTS = {
    "gemma3": " (Gemma 3's multimodal config: pass its text_config, model_type 'gemma3_text', to model the "
              "language model; the vision tower is not modelled)",
    "gemma": " (Gemma 1 is not modelled; Gemma 2 and Gemma 3 are: model_type 'gemma2', 'gemma3_text')",
}
