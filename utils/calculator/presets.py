"""Presets: the published shapes of public models, read from the shipped config files (``configs/*.json``).

Each preset is the course's ``"llama"`` design (``llama_like``) with that model's shape, so that notebook 12's
tables keep their meaning; ``predict_hf`` on the same config file replays transformers' own implementation
(its cache, mask and ``labels=`` loss), which is what the reader's training script runs.
"""

from __future__ import annotations

from typing import Any, Callable

from .config import ModelConfig
from .from_transformers import model_config_from_hf

# preset -> (shipped config, its name in tables)
PRESET_CONFIGS = {"1B": ("llama-3.2-1b", "Llama-3.2-1B"), "7B": ("llama-2-7b", "Llama-2-7B"),
                  "13B": ("llama-2-13b", "Llama-2-13B"), "70B": ("llama-2-70b", "Llama-2-70B")}


def _course_design(config_name: str, name: str) -> ModelConfig:
    hf = model_config_from_hf(config_name)
    return ModelConfig(num_layers=hf.num_layers, d_model=hf.d_model, num_heads=hf.num_heads,
                       vocab_size=hf.vocab_size, ffn_width=hf.ffn_width,
                       num_kv_heads=hf.num_kv_heads if hf.kv_heads != hf.num_heads else None,
                       max_seq_len=hf.max_seq_len, arch="llama", tied_embeddings=hf.tied_embeddings, name=name)


PRESETS: dict[str, ModelConfig] = {key: _course_design(*source) for key, source in PRESET_CONFIGS.items()}


def preset(name: str) -> ModelConfig:
    """The ``ModelConfig`` of a preset (``"1B"``, ``"7B"``, ``"13B"``, ``"70B"``).

    Raises:
        ValueError: an unknown name (the message lists the presets and the models they are).
    """
    if name not in PRESETS:
        known = ", ".join(f"{key} ({cfg.name})" for key, cfg in PRESETS.items())
        raise ValueError(f"unknown preset {name!r}: expected one of {known}")
    return PRESETS[name]


SHAPE_FLAGS = {"num_layers": "layers", "d_model": "d_model", "num_heads": "heads", "vocab_size": "vocab",
               "ffn_width": "ffn", "num_kv_heads": "kv_heads", "max_seq_len": "max_seq_len"}


def model_from_args(args: Any, error: Callable[[str], Any]) -> ModelConfig:
    """The model the command line describes: ``--hf-config``, ``--preset`` or a shape (``--layers --d-model ...``).

    ``error(message)`` reports a usage error (argparse's ``parser.error``, or a function that raises)."""
    custom = {field: getattr(args, flag) for field, flag in SHAPE_FLAGS.items()}
    given = [field for field, value in custom.items() if value is not None]
    if args.hf_config:
        if given or args.arch or args.tied or args.preset:
            error(f"--hf-config {args.hf_config} fixes the shape: expected no --preset or shape flags with it")
        return model_config_from_hf(args.hf_config, attention=args.attn)
    if args.attn:
        error("--attn is for transformers' models: expected it with --hf-config")
    if args.preset:
        if given or args.arch or args.tied:
            error(f"--preset {args.preset} fixes the shape: expected no shape flags with it, got {given}")
        return PRESETS[args.preset]
    missing = [flag for flag in ("--layers", "--d-model", "--heads", "--vocab")
               if getattr(args, flag[2:].replace("-", "_")) is None]
    if missing:
        error(f"expected --preset or a shape: missing {', '.join(missing)}")
    custom = {key: value for key, value in custom.items() if value is not None}
    custom.setdefault("max_seq_len", max(args.seq_len, 2048))
    return ModelConfig(arch=args.arch or "llama", tied_embeddings=args.tied, **custom)
