"""The reader's own model: a transformers config (and peft's ``LoraConfig``) read into the calculator.

``predict_hf(config, setup, lora=...)`` predicts one training step of the model transformers builds from
``config`` (``AutoModelForCausalLM.from_config``), trained as ``validate_hf.hf_reference_step`` writes it:
``loss = model(input_ids, attention_mask=..., labels=...).loss``, ``loss.backward()``, ``optimizer.step()``,
``optimizer.zero_grad(set_to_none=True)``. ``load_hf_config`` loads a shipped config (``configs/*.json``,
each with its source) by short name, or a config.json by path. Reading a config needs no transformers;
only a ``PretrainedConfig`` or ``LoraConfig`` passed in brings its package along.

Supported: the Llama family (``model_type`` in ``HF_MODEL_TYPES``: llama, mistral, qwen2; the models that
share ``LlamaDecoderLayer``'s design) and GPT-2 (``GPT2LMHeadModel``: its dropouts as configured, its
``activation_function``), each step replayed. Anything else is a ``ValueError`` that lists them.
"""

from __future__ import annotations

import json
import os
from dataclasses import replace
from pathlib import Path
from typing import Any, Mapping

from .config import ModelConfig, TrainingSetup

CONFIG_DIR = Path(__file__).with_name("configs")
SHIPPED_CONFIGS = {
    "llama-3.2-1b": "llama-3.2-1b.json", "llama-2-7b": "llama-2-7b.json", "llama-2-13b": "llama-2-13b.json",
    "llama-2-70b": "llama-2-70b.json", "mistral-7b": "mistral-7b.json", "qwen2.5-7b": "qwen2.5-7b.json",
    "gpt2": "gpt2.json",
}
# model_type -> the design the replay knows (transformers' class for the Llama family shares its block)
HF_MODEL_TYPES = {"llama": "hf-llama", "mistral": "hf-llama", "qwen2": "hf-llama", "gpt2": "hf-gpt2"}
_LLAMA_FIELDS = ("num_hidden_layers", "hidden_size", "num_attention_heads", "vocab_size", "intermediate_size")
_GPT2_FIELDS = ("n_layer", "n_embd", "n_head", "vocab_size")


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
    """The calculator's ``ModelConfig`` of a transformers config (arch ``"hf-llama"`` or ``"hf-gpt2"``).

    Args:
        config: a ``PretrainedConfig``, a dict of its fields, or a config.json path / shipped name.
        attention: ``"sdpa"`` or ``"eager"``; default: the config's ``_attn_implementation`` (or
            ``attn_implementation``) when it names one, else ``"sdpa"``, transformers' default.

    Raises:
        ValueError: an unsupported ``model_type`` (the message lists the supported ones), a missing field
            the calculator needs (named), an activation or attention the replay does not know.
    """
    fields = _config_dict(config)
    model_type = fields.get("model_type")
    if model_type not in HF_MODEL_TYPES:
        raise ValueError(f"model_type {model_type!r} is not modelled: expected one of {sorted(HF_MODEL_TYPES)} "
                         "(the Llama family, whose decoder layer the replay knows, and GPT-2)")
    arch = HF_MODEL_TYPES[model_type]
    needed = _LLAMA_FIELDS if arch == "hf-llama" else _GPT2_FIELDS
    missing = [name for name in needed if fields.get(name) is None]
    if missing:
        raise ValueError(f"the {model_type} config lacks {missing}: expected every one of {list(needed)}")
    attention = attention or fields.get("_attn_implementation") or fields.get("attn_implementation") or "sdpa"
    if attention not in ("sdpa", "eager"):
        raise ValueError(f"attn_implementation {attention!r} is not modelled: expected 'sdpa' or 'eager'")
    name = fields.get("_name_or_path") or fields.get("name") or model_type
    if arch == "hf-gpt2":
        act = fields.get("activation_function", "gelu_new")
        if act not in ("gelu_new", "gelu_pytorch_tanh", "gelu"):
            raise ValueError(f"GPT-2 activation_function {act!r} is not modelled: expected 'gelu_new', "
                             "'gelu_pytorch_tanh' or 'gelu'")
        unsupported = [key for key in ("add_cross_attention", "reorder_and_upcast_attn") if fields.get(key)]
        if unsupported or fields.get("scale_attn_weights", True) is False:
            raise ValueError(f"GPT-2 with {unsupported or ['scale_attn_weights=False']} is not modelled: expected "
                             "the defaults (add_cross_attention=False, reorder_and_upcast_attn=False, "
                             "scale_attn_weights=True)")
        dropout = tuple(float(fields.get(key, 0.1)) for key in ("embd_pdrop", "attn_pdrop", "resid_pdrop"))
        return ModelConfig(num_layers=fields["n_layer"], d_model=fields["n_embd"], num_heads=fields["n_head"],
                           vocab_size=fields["vocab_size"], ffn_width=fields.get("n_inner") or 4 * fields["n_embd"],
                           max_seq_len=fields.get("n_positions", 1024), arch=arch,
                           tied_embeddings=fields.get("tie_word_embeddings", True), name=str(name),
                           attention=attention, use_cache=fields.get("use_cache", True), dropout=dropout,
                           activation=act)
    act = fields.get("hidden_act", "silu")
    if act != "silu":
        raise ValueError(f"hidden_act {act!r} is not modelled: expected 'silu' (Llama's SwiGLU)")
    heads = fields["num_attention_heads"]
    head_dim = fields.get("head_dim") or fields["hidden_size"] // heads
    bias = bool(fields.get("attention_bias", False))
    window = fields.get("sliding_window") if model_type == "mistral" else (
        fields.get("sliding_window") if fields.get("use_sliding_window") else None)
    return ModelConfig(
        num_layers=fields["num_hidden_layers"], d_model=fields["hidden_size"], num_heads=heads,
        vocab_size=fields["vocab_size"], ffn_width=fields["intermediate_size"],
        num_kv_heads=fields.get("num_key_value_heads") or heads,
        max_seq_len=fields.get("max_position_embeddings", 2048), arch=arch,
        tied_embeddings=bool(fields.get("tie_word_embeddings", False)), name=str(name),
        head_width=head_dim if head_dim * heads != fields["hidden_size"] else None,
        qkv_bias=bias or model_type == "qwen2", out_bias=bias, mlp_bias=bool(fields.get("mlp_bias", False)),
        attention=attention, sliding_window=window or None, use_cache=bool(fields.get("use_cache", True)))


def lora_overrides(lora: Any) -> dict[str, Any]:
    """``TrainingSetup`` fields of a peft ``LoraConfig`` (rank, targets, dropout).

    Raises:
        ValueError: what the replay does not model (DoRA, LoRA biases, ``modules_to_save``, a regex target).
    """
    rank = getattr(lora, "r", None)
    if not isinstance(rank, int) or rank < 1:
        raise TypeError(f"lora must be a peft LoraConfig (r >= 1), got {type(lora).__name__}")
    if getattr(lora, "use_dora", False) or getattr(lora, "bias", "none") != "none" or getattr(lora, "modules_to_save", None):
        raise ValueError("the replay models plain LoRA: expected use_dora=False, bias='none', modules_to_save=None")
    targets = getattr(lora, "target_modules", None)
    if targets is None:
        targets = ("q_proj", "v_proj")                # peft's default for the Llama family
    if isinstance(targets, str):
        if targets != "all-linear":
            raise ValueError(f"target_modules {targets!r}: expected a list of module names or 'all-linear' (a regex "
                             "is not modelled)")
        targets = "all"
    else:
        targets = tuple(sorted(targets))
    return {"lora_rank": rank, "lora_targets": targets, "lora_dropout": float(getattr(lora, "lora_dropout", 0.0))}


def predict_hf(config: Any, setup: TrainingSetup | None = None, *, lora: Any = None, **setup_overrides: Any):
    """Predict one training step of a transformers model from its config: ``predict`` for the reader's model.

    Why: the course's ``llama_like`` is Llama as the course writes it; this is transformers' own code
    (its cache, mask, rotary embedding, ``labels=`` loss, checkpointing and peft's casts), which the
    tests measure on real models (``validate_hf``).

    Args:
        config: a ``transformers.PretrainedConfig``, a dict of its fields, or a config.json path (or a
            shipped name, ``load_hf_config``'s).
        setup: how it trains (default ``TrainingSetup()``: micro-batch 1 x 2048, bf16 autocast, AdamW).
        lora: a ``peft.LoraConfig`` (rank, target_modules, lora_dropout), or None for full fine-tuning.
        **setup_overrides: ``TrainingSetup`` fields to replace (``seq_len=4096``, ``checkpointing=
            "every_block"`` for ``gradient_checkpointing_enable()``, ``padded=True``, ``loss="logits"``).

    Returns:
        The ``MemoryBreakdown`` (``Prediction``) ``predict`` returns: ``.total`` is the peak in bytes.

    Raises:
        ValueError: an unsupported model type or missing field, a LoRA target that names no module, a
            set-up the replay does not model for transformers' models (a chunked loss, selective
            checkpointing); checked before any work.

    Example:
        >>> from peft import LoraConfig
        >>> predict_hf("llama-2-7b", TrainingSetup(seq_len=4096), lora=LoraConfig(r=8, target_modules="all-linear"))
    """
    from .predict import predict

    model = model_config_from_hf(config)
    setup = setup if setup is not None else TrainingSetup()
    if not isinstance(setup, TrainingSetup):
        raise TypeError(f"setup must be a TrainingSetup, got {type(setup).__name__}")
    if lora is not None:
        overrides = lora_overrides(lora)
        if model.arch == "hf-gpt2" and getattr(lora, "target_modules", None) is None:
            overrides["lora_targets"] = ("c_attn",)   # peft's default for GPT-2
        setup_overrides = {**overrides, **setup_overrides}
    if setup_overrides:
        setup = replace(setup, **setup_overrides)
    return predict(model, setup)
