"""The reader's own model: a transformers config (and peft's ``LoraConfig``, and the training options passed to
transformers and torch) read into the calculator.

``predict_hf(config, setup, lora=...)`` predicts one training step of the model transformers builds from
``config`` (``AutoModelForCausalLM.from_config``), trained as ``validate_hf.hf_reference_step`` writes it.
``load_hf_config`` loads a shipped config (``configs/*.json``, each with its source) by short name, or a
config.json by path. Reading a config needs no transformers; only a ``PretrainedConfig`` or ``LoraConfig`` passed
in brings its package along.

The config's ``model_type`` picks the family (``registry.py``), which reads it field by field
(``families/base.py``): a field it does not replay, list as harmless, or refuse at a non-default value is an
error. ``LORA_FIELDS``, ``CHECKPOINT_KWARGS`` and ``ATTENTION_IMPLEMENTATIONS`` do the same for peft's
``LoraConfig``, ``gradient_checkpointing_kwargs`` and ``attn_implementation``; ``optimizers.OPTIMIZER_OPTIONS``
for the optimizer's arguments.
"""

from __future__ import annotations

import json
import os
from dataclasses import replace
from pathlib import Path
from typing import Any, Mapping

from . import registry
from .config import ModelConfig, TrainingSetup
from .families.base import FieldRules

CONFIG_DIR = Path(__file__).with_name("configs")
SHIPPED_CONFIGS = {
    "llama-3.2-1b": "llama-3.2-1b.json", "llama-2-7b": "llama-2-7b.json", "llama-2-13b": "llama-2-13b.json",
    "llama-2-70b": "llama-2-70b.json", "mistral-7b": "mistral-7b.json", "qwen2.5-7b": "qwen2.5-7b.json",
    "qwen3-8b": "qwen3-8b.json", "phi-3-mini-4k": "phi-3-mini-4k.json", "gemma-2-9b": "gemma-2-9b.json",
    "gemma-3-4b-text": "gemma-3-4b-text.json", "gpt2": "gpt2.json",
    "mixtral-8x7b": "mixtral-8x7b.json", "qwen3-30b-a3b": "qwen3-30b-a3b.json", "olmoe-1b-7b": "olmoe-1b-7b.json",
}


class _ModelTypes(Mapping):
    """model_type -> the arch of the family that reads it (read from the registry when asked)."""

    def __getitem__(self, key: str) -> str:
        try:
            return registry.family_for_model_type(key).arch
        except ValueError:
            raise KeyError(key) from None

    def __iter__(self):  # noqa: ANN204
        return iter(registry.model_types())

    def __len__(self) -> int:
        return len(registry.model_types())


HF_MODEL_TYPES = _ModelTypes()

# peft's LoraConfig (0.21): what each field does to training memory
LORA_FIELDS = FieldRules(
    frozenset({"r", "target_modules", "lora_dropout"}),
    {"task_type": "the wrapper class; the same tensors", "peft_type": "LoRA", "auto_mapping": "a loading detail",
     "peft_version": "the version that wrote it", "base_model_name_or_path": "a name", "revision": "a name",
     "lora_alpha": "the scaling, a number", "use_rslora": "the scaling, a number",
     "alpha_pattern": "per-module scalings, numbers", "init_lora_weights": "the adapters' initial values",
     "loftq_config": "the initial values", "eva_config": "the initial values", "corda_config": "the initial values",
     "lora_ga_config": "the initial values", "megatron_core": "used only with megatron_config",
     "qalora_group_size": "used only with use_qalora",
     "fan_in_fan_out": "peft sets it from the layer (True for GPT-2's Conv1D, False for a Linear)",
     "ensure_weight_tying": "the adapters of tied embeddings; the calculator adapts the blocks' layers only"},
    {"inference_mode": False, "exclude_modules": None, "bias": "none", "modules_to_save": None,
     "layers_to_transform": None, "layers_pattern": None, "rank_pattern": {}, "megatron_config": None,
     "trainable_token_indices": None, "use_dora": False, "velora_config": None, "alora_invocation_tokens": None,
     "use_qalora": False, "monteclora_config": None, "layer_replication": None, "lora_bias": False,
     "target_parameters": None, "use_bdlora": None, "arrow_config": None, "kasa_config": None,
     "runtime_config": "LoraRuntimeConfig(ephemeral_gpu_offload=False)"})

# torch.utils.checkpoint.checkpoint's keyword arguments, as gradient_checkpointing_kwargs passes them
CHECKPOINT_KWARGS = FieldRules(
    frozenset({"use_reentrant"}),
    {"preserve_rng_state": "the RNG states it saves are a few KB in host memory",
     "determinism_check": "a check of the recompute's metadata", "debug": "a trace of the recompute"},
    {"context_fn": None, "early_stop": True})
# transformers' attn_implementation: replayed, or refused with what to use
ATTENTION_IMPLEMENTATIONS = {"sdpa": "replayed", "eager": "replayed",
                             "flash_attention_2": "refused", "flash_attention_3": "refused",
                             "flash_attention_4": "refused", "flex_attention": "refused", "paged|eager": "refused",
                             "paged|sdpa": "refused", "paged|flash_attention_2": "refused"}


def load_hf_config(name_or_path: str | os.PathLike, *, as_dict: bool = False) -> Any:
    """A transformers config: a shipped one by short name (``SHIPPED_CONFIGS``), or a config.json by path.

    Args:
        name_or_path: ``"llama-2-7b"``, ``"llama-2-13b"``, ``"llama-2-70b"``, ``"llama-3.2-1b"``,
            ``"mistral-7b"``, ``"qwen2.5-7b"``, ``"gpt2"``; or the path of a config.json.
        as_dict: return the plain dict (no transformers import) instead of a ``PretrainedConfig``.

    Returns:
        ``transformers.AutoConfig.for_model(model_type, **fields)`` (random weights follow from
        ``AutoModelForCausalLM.from_config(config)``; nothing is downloaded), or the dict.

    Raises:
        ValueError: a name that is neither shipped nor an existing file (the message lists the names), or a
            file that is not a JSON object with a ``model_type``.

    Example:
        >>> config = load_hf_config("llama-3.2-1b")
        >>> predict_hf(config, TrainingSetup(seq_len=2048)).total / 2**30
    """
    fields = _read_config(name_or_path)
    if as_dict:
        return fields
    from transformers import AutoConfig

    fields = {k: v for k, v in fields.items() if not k.startswith("_")}
    return AutoConfig.for_model(fields.pop("model_type"), **fields)


def _read_config(name_or_path: Any) -> dict[str, Any]:
    if not isinstance(name_or_path, (str, os.PathLike)):
        raise TypeError(f"expected a shipped config's name or a config.json path, got {type(name_or_path).__name__}")
    key = str(name_or_path)
    path = CONFIG_DIR / SHIPPED_CONFIGS[key.lower()] if key.lower() in SHIPPED_CONFIGS else Path(key)
    if not path.is_file():
        raise ValueError(f"no config {key!r}: expected one of {sorted(SHIPPED_CONFIGS)} or the path of a config.json")
    try:
        fields = json.loads(path.read_text())
    except json.JSONDecodeError as error:
        raise ValueError(f"{path} is not JSON ({error}): expected a transformers config.json") from error
    if not isinstance(fields, dict) or "model_type" not in fields:
        raise ValueError(f"{path}: expected a transformers config.json, a JSON object with a 'model_type'")
    fields.setdefault("_name_or_path", key.lower() if key.lower() in SHIPPED_CONFIGS else
                      (path.parent.name if path.name == "config.json" and path.parent.name else path.stem))
    return fields


def _config_dict(config: Any) -> dict[str, Any]:
    """A config as a plain dict, from a ``PretrainedConfig``, a mapping, a path or a shipped name."""
    if isinstance(config, Mapping):
        return dict(config)
    if isinstance(config, (str, os.PathLike)):
        return _read_config(config)
    to_dict = getattr(config, "to_dict", None)
    if callable(to_dict):
        fields = to_dict()
        attn = getattr(config, "_attn_implementation", None)
        if attn:
            fields["_attn_implementation"] = attn
        return fields
    raise TypeError(f"config must be a transformers PretrainedConfig, a dict or a config.json path, got "
                    f"{type(config).__name__}")


def model_config_from_hf(config: Any, *, attention: str | None = None) -> ModelConfig:
    """The calculator's ``ModelConfig`` of a transformers config (its family picked by ``model_type``).

    Args:
        config: a ``PretrainedConfig``, a dict of its fields, or a config.json path / shipped name.
        attention: transformers' ``attn_implementation``; default: the config's ``_attn_implementation`` (or
            ``attn_implementation``) when it names one, else ``"sdpa"`` (``"eager"`` for Gemma 2, which does not
            support sdpa).

    Raises:
        ValueError: an unsupported ``model_type`` (the message lists the supported ones), a missing field the
            calculator needs, a field set to something it does not model (each named), an attention it does not
            replay.
    """
    fields = _config_dict(config)
    family = registry.family_for_model_type(fields.get("model_type"))
    chosen = attention or fields.get("_attn_implementation") or fields.get("attn_implementation")
    chosen = chosen or getattr(family, "default_attention", "sdpa")
    if ATTENTION_IMPLEMENTATIONS.get(chosen) != "replayed":
        raise ValueError(f"attn_implementation {chosen!r} is not modelled (its kernels' saved tensors are not "
                         f"replayed): expected 'sdpa' or 'eager'")
    name = fields.get("_name_or_path") or fields.get("name") or fields["model_type"]
    return family.read_config(fields, chosen, str(name))


def _fields_of(obj: Any) -> dict[str, Any]:
    """A config object's fields as a dict (a dataclass's, ``to_dict()``'s, or a mapping itself)."""
    if isinstance(obj, Mapping):
        return dict(obj)
    import dataclasses

    if dataclasses.is_dataclass(obj):
        return {f.name: getattr(obj, f.name) for f in dataclasses.fields(obj)}
    return dict(vars(obj))


def lora_overrides(lora: Any) -> dict[str, Any]:
    """``TrainingSetup`` fields of a peft ``LoraConfig`` (rank, targets, dropout), its other fields checked.

    Raises:
        ValueError: a field that changes what trains or how (DoRA, LoRA biases, ``modules_to_save``, a rank
            pattern, a regex target, ...), named.
    """
    rank = getattr(lora, "r", None)
    if isinstance(rank, bool) or not isinstance(rank, int) or rank < 1:
        raise TypeError(f"lora must be a peft LoraConfig (r >= 1), got {type(lora).__name__}")
    fields = _fields_of(lora)
    for name, value in fields.items():
        if name in LORA_FIELDS.refused:
            default = LORA_FIELDS.refused[name]
            same = (str(value) == default) if name == "runtime_config" else (
                value == default or (not value and not default))
            if hasattr(value, "value"):                  # peft's enums
                same = same or value.value == default
            if not same:
                raise ValueError(f"LoraConfig {name}={value!r} is not modelled (the replay models plain LoRA on "
                                 f"the blocks' linear layers): expected {default!r}")
        elif name not in LORA_FIELDS.decided() and value not in (None, False, {}, [], ()):
            raise ValueError(f"LoraConfig field {name}={value!r} is not one peft 0.21 has, and the calculator does "
                             "not know what it changes: expected it unset")
    targets = fields.get("target_modules")
    if targets is None:
        targets = None                                   # the family's peft default (set by predict_hf)
    elif isinstance(targets, str):
        if targets != "all-linear":
            raise ValueError(f"target_modules {targets!r}: expected a list of module names or 'all-linear' (a regex "
                             "is not modelled)")
        targets = "all"
    else:
        targets = tuple(sorted(targets))
    out = {"lora_rank": rank, "lora_dropout": float(fields.get("lora_dropout", 0.0))}
    if targets is not None:
        out["lora_targets"] = targets
    return out


def checkpoint_overrides(kwargs: Mapping[str, Any] | None) -> dict[str, Any]:
    """``TrainingSetup`` fields of ``gradient_checkpointing_kwargs`` (as ``gradient_checkpointing_enable`` and
    ``activation_checkpointing_enable`` pass them to ``torch.utils.checkpoint.checkpoint``).

    transformers' default is ``{"use_reentrant": False}``; ``use_reentrant=True`` is replayed (``reentrant``).

    Raises:
        ValueError: a keyword that changes the recompute (``context_fn``, ``early_stop=False``) or one torch does not
            have, named.
    """
    if kwargs is None:
        return {}
    if not isinstance(kwargs, Mapping):
        raise TypeError(f"gradient_checkpointing_kwargs must be a dict, got {type(kwargs).__name__}")
    for name, value in kwargs.items():
        if name in CHECKPOINT_KWARGS.refused:
            if value != CHECKPOINT_KWARGS.refused[name] and not (name == "context_fn" and getattr(
                    value, "__name__", "") == "noop_context_fn"):
                raise ValueError(f"gradient_checkpointing_kwargs {name}={value!r} is not modelled (it changes what "
                                 f"the recompute keeps): expected {CHECKPOINT_KWARGS.refused[name]!r}")
        elif name not in CHECKPOINT_KWARGS.decided():
            raise ValueError(f"gradient_checkpointing_kwargs {name!r} is not an argument of "
                             f"torch.utils.checkpoint.checkpoint: expected one of {sorted(CHECKPOINT_KWARGS.decided())}")
    return {"reentrant": bool(kwargs.get("use_reentrant", False))}


def predict_hf(config: Any, setup: TrainingSetup | None = None, *, lora: Any = None,
               gradient_checkpointing_kwargs: Mapping[str, Any] | None = None, attn_implementation: str | None = None,
               **setup_overrides: Any):
    """Predict one training step of a transformers model from its config: ``predict`` for the reader's model.

    Why: the course's ``llama_like`` is Llama as the course writes it; this is transformers' own code
    (its cache, masks, rotary embedding, ``labels=`` loss, checkpointing and peft's casts), which the
    tests measure on real models (``validate_hf``).

    Args:
        config: a ``transformers.PretrainedConfig``, a dict of its fields, or a config.json path (or a
            shipped name, ``load_hf_config``'s).
        setup: how it trains (default ``TrainingSetup()``: micro-batch 1 x 2048, bf16 autocast, AdamW, and the
            loop that keeps the model's output in a variable, ``outputs="kept"``).
        lora: a ``peft.LoraConfig`` (rank, target_modules, lora_dropout; its other fields checked), or None for
            full fine-tuning.
        gradient_checkpointing_kwargs: what you pass to ``gradient_checkpointing_enable`` (``{"use_reentrant":
            True}`` is replayed; with it, give ``checkpointing="every_block"``).
        attn_implementation: ``"sdpa"`` or ``"eager"`` (default: the config's).
        **setup_overrides: ``TrainingSetup`` fields to replace (``seq_len=4096``, ``checkpointing=
            "every_block"`` for ``gradient_checkpointing_enable()``, ``padded=True``, ``loss="logits"``,
            ``outputs="dropped"``, ``optimizer_options={"weight_decay": 0.01}``).

    Returns:
        The ``MemoryBreakdown`` (``Prediction``) ``predict`` returns: ``.total`` is the peak in bytes.

    Raises:
        ValueError: an unsupported model type or missing field, a config field, LoRA field or option it does not
            model (named), a LoRA target that names no module, a set-up the replay does not model for
            transformers' models (a chunked loss, selective checkpointing); checked before any work.

    Example:
        >>> from peft import LoraConfig
        >>> predict_hf("llama-2-7b", TrainingSetup(seq_len=4096), lora=LoraConfig(r=8, target_modules="all-linear"))
    """
    from .predict import predict

    model = model_config_from_hf(config, attention=attn_implementation)
    setup = setup if setup is not None else TrainingSetup()
    if not isinstance(setup, TrainingSetup):
        raise TypeError(f"setup must be a TrainingSetup, got {type(setup).__name__}")
    overrides = checkpoint_overrides(gradient_checkpointing_kwargs)
    if lora is not None:
        overrides.update(lora_overrides(lora))
        overrides.setdefault("lora_targets", registry.family_of(model.arch).peft_default_targets(model))
    setup_overrides = {**overrides, **setup_overrides}
    if setup_overrides:
        setup = replace(setup, **setup_overrides)
    return predict(model, setup)
