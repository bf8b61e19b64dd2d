"""What a model is to ``model_parallel.py``: its parameter tensors, each with the dimension tensor parallelism
splits and the pipeline place it lives in (``ParallelTensor``), and the shape of one layer's activations
(``ParallelModel``), read from a calculator ``ModelConfig``, a transformers config or an ``nn.Module`` with the
``parallelize_module`` plan of one of its blocks. Split from ``model_parallel.py`` to keep each file one sitting.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

from .config import ModelConfig
from .dataparallel import _DataParallel
from .shapes import parameter_shapes

DESIGNS = ("gpt", "llama")            # per-layer activations: LayerNorm + GELU MLP, or RMSNorm + SwiGLU + GQA

# which dimension tensor parallelism splits, by the end of a parameter's name (the Megatron layout)
_COLUMN = ("qkv", "q_proj", "k_proj", "v_proj", "gate_proj", "up_proj", "mlp.0", "c_attn", "c_fc")
_ROW = ("proj", "o_proj", "down_proj", "mlp.2", "c_proj")
_VOCAB = ("token_embedding", "embed_tokens", "wte", "head", "lm_head")

# --- the model ---------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class ParallelTensor:
    """One parameter tensor: its shape, the dimension tensor parallelism splits (None: whole on every rank), and
    where it lives: a layer index, or ``"first"`` / ``"last"`` (before or after the layers: the pipeline's ends)."""

    name: str
    shape: tuple[int, ...]
    tp_dim: int | None
    place: int | str


@dataclass(frozen=True)
class ParallelModel:
    """A model as this module sees it: parameter tensors and one layer's activation shape.

    Attributes:
        name: for tables.
        tensors: every parameter (``ParallelTensor``), in ``model.parameters()`` order.
        layers: transformer blocks.
        width, heads, kv_heads, ffn, vocab: the activation shape (``vocab`` 0: no output head; the model
            ends in a regression loss on its last hidden state, as notebook 13's stack does).
        design: ``"gpt"`` (LayerNorm, GELU MLP ``ffn`` wide; also notebook 13's ``Block``) or ``"llama"``
            (RMSNorm, SwiGLU, grouped-query attention).
        embedded: the first layer's input comes from an embedding (an activation); False: it is the batch.
    """

    name: str
    tensors: tuple[ParallelTensor, ...]
    layers: int
    width: int
    heads: int
    kv_heads: int
    ffn: int
    vocab: int
    design: str = "gpt"
    embedded: bool = True

    @classmethod
    def from_config(cls, model: ModelConfig) -> "ParallelModel":
        """A calculator ``ModelConfig`` (designs ``"gpt"``, ``"llama"``, ``"hf-llama"``) with the Megatron layout."""
        if not isinstance(model, ModelConfig):
            raise TypeError(f"expected a utils.calculator.ModelConfig, got {type(model).__name__}")
        if model.arch == "hf-gpt2":
            raise ValueError("GPT-2's Conv1D weights are stored transposed and its step is not replayed: expected a "
                             "design 'gpt', 'llama' or 'hf-llama'")
        if model.head_dim * model.num_heads != model.d_model:
            raise ValueError(f"a head width of {model.head_dim} x {model.num_heads} heads != d_model {model.d_model}: "
                             "expected heads that tile the width")
        shapes = [(name, tuple(shape)) for name, shape, _ in parameter_shapes(model)]
        tensors = tuple(ParallelTensor(name, shape, _tp_dim_by_name(name, shape), place)
                        for (name, shape), place in zip(shapes, _places([name for name, _ in shapes])))
        return cls(name=model.name, tensors=tensors, layers=model.num_layers, width=model.d_model,
                   heads=model.num_heads, kv_heads=model.kv_heads, ffn=model.ffn, vocab=model.vocab_size,
                   design="gpt" if model.arch == "gpt" else "llama")

    @classmethod
    def from_hf(cls, config: Any) -> "ParallelModel":
        """A transformers config (a ``PretrainedConfig``, a dict, a config.json path or a shipped name)."""
        from .hf import model_config_from_hf
        return cls.from_config(model_config_from_hf(config))

    @classmethod
    def from_module(cls, module: Any, plan: Mapping[str, Any], *, heads: int, name: str = "module",
                    design: str = "gpt") -> "ParallelModel":
        """An ``nn.Module`` whose blocks ``plan`` (one block's ``parallelize_module`` plan) splits.

        Parameters inside ``layers.<i>.`` (or ``blocks.<i>.``, ``h.<i>.``: ``dataparallel``'s FSDP units) are layer
        ``i``, the plan's names relative to the block; a module with no such list is one layer, the plan's names
        relative to the module. ``ColwiseParallel`` splits a weight's dim 0 (and its bias), ``RowwiseParallel``
        its dim 1 (the bias stays whole); everything else is whole on every rank. The first layer's input is the
        batch (no embedding) and ``vocab`` is 0.
        """
        from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel
        named = [(n, tuple(p.shape)) for n, p in module.named_parameters()]
        units = [_DataParallel.unit_of(None, n) for n, _ in named]
        stacked = any(unit >= 0 for unit in units)
        tensors = []
        for (full, shape), place in zip(named, _places([n for n, _ in named]) if stacked else [0] * len(named)):
            local = _inside_block(full) if stacked and isinstance(place, int) else full
            owner, _, kind = local.rpartition(".")
            style = plan.get(owner)
            tp_dim = None
            if isinstance(style, ColwiseParallel):
                tp_dim = 0
            elif isinstance(style, RowwiseParallel) and kind == "weight":
                tp_dim = 1
            tensors.append(ParallelTensor(full, shape, tp_dim, place))
        layers = max(u for u in units) + 1 if stacked else 1
        width = next(shape[0] for n, shape in named if n.endswith("norm.weight"))
        matrices = [shape for t, (_, shape) in zip(tensors, named) if t.tp_dim == 0 and len(shape) == 2]
        ffn = max(shape[0] for shape in matrices)
        return cls(name=name, tensors=tuple(tensors), layers=layers, width=width, heads=heads, kv_heads=heads,
                   ffn=ffn, vocab=0, design=design, embedded=False)


def _inside_block(name: str) -> str:
    """``model.layers.3.attention.q.weight`` -> ``attention.q.weight``: the name inside its block."""
    parts = name.split(".")
    for i, (part, index) in enumerate(zip(parts, parts[1:])):
        if part in ("blocks", "layers", "h") and index.isdigit():
            return ".".join(parts[i + 2:])
    return name


def _tp_dim_by_name(name: str, shape: tuple[int, ...]) -> int | None:
    parts = name.split(".")
    owner, kind = ".".join(parts[:-1]), parts[-1]
    if any(owner == c or owner.endswith("." + c) for c in _COLUMN):
        return 0
    if any(owner == r or owner.endswith("." + r) for r in _ROW):
        return 1 if kind == "weight" else None
    if any(owner == v or owner.endswith("." + v) for v in _VOCAB):
        return 0
    return None


def _places(names: Sequence[str]) -> list[int | str]:
    """Each parameter's layer (``dataparallel``'s FSDP unit), or the pipeline end it sits at."""
    units = [_DataParallel.unit_of(None, name) for name in names]
    first = next((i for i, unit in enumerate(units) if unit >= 0), len(units))
    return [unit if unit >= 0 else ("first" if i < first else "last") for i, unit in enumerate(units)]


def as_parallel_model(model: Any) -> ParallelModel:
    """A ``ParallelModel`` from what the reader has: itself, a ``ModelConfig``, or a transformers config."""
    if isinstance(model, ParallelModel):
        return model
    if isinstance(model, ModelConfig):
        return ParallelModel.from_config(model)
    if isinstance(model, (str, os.PathLike, dict)) or hasattr(model, "to_dict"):
        return ParallelModel.from_hf(model)
    raise TypeError(f"expected a ParallelModel, a utils.calculator.ModelConfig or a transformers config, got "
                    f"{type(model).__name__}")


