"""What a model is to model parallelism (``model_parallel.py``): its parameter tensors, each with the dimension tensor
parallelism splits and the pipeline place it lives in (``ParallelTensor``), and the shape of one layer's activations
(``ParallelModel``), read from a calculator ``ModelConfig`` (the family says which dimension each tensor splits),
a transformers config, or an ``nn.Module`` with the ``parallelize_module`` plan of one of its blocks.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

from . import registry
from .config import ModelConfig
from .data_parallel import unit_of
from .shapes import parameter_shapes

DESIGNS = ("gpt", "llama", "moe")     # per-layer activations: LayerNorm + GELU MLP, RMSNorm + SwiGLU + GQA, or that
                                      # attention with a sparse MoE layer (expert_parallel.py)

# --- the model ---------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class ParallelTensor:
    """One parameter tensor: its shape, the dimension tensor parallelism splits (None: whole on every rank), and
    where it lives: a layer index, or ``"first"`` / ``"last"`` (before or after the layers: the pipeline's ends);
    ``expert``: a stack of experts, dim 0 one per expert (expert parallelism splits it)."""

    name: str
    shape: tuple[int, ...]
    tp_dim: int | None
    place: int | str
    expert: bool = False


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
        experts, top_k, expert_ffn, normalize: a mixture of experts' layer (``experts`` 0: a dense model): experts
            per layer, per token, each expert's width, the top-k weights renormalised.
        dense_layers: layers whose MLP is dense in a mixture of experts (Qwen3-MoE's ``mlp_only_layers``).
        head_dim: each head's width where the heads do not tile the width (Qwen3-MoE's 128 x 32 heads on 2048;
            the ``moe`` design reads it); 0: ``width / heads``.
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
    experts: int = 0
    top_k: int = 0
    expert_ffn: int = 0
    normalize: bool = True
    dense_layers: tuple[int, ...] = ()
    head_dim: int = 0

    @classmethod
    def from_config(cls, model: ModelConfig) -> "ParallelModel":
        """A calculator ``ModelConfig`` with the Megatron layout (its family says which dimension each tensor splits
        and whose per-layer activations it has)."""
        if not isinstance(model, ModelConfig):
            raise TypeError(f"expected a utils.calculator.ModelConfig, got {type(model).__name__}")
        family = registry.family_of(model.arch)
        design = family.activation_design()
        if model.head_dim * model.num_heads != model.d_model and design != "moe":
            raise ValueError(f"a head width of {model.head_dim} x {model.num_heads} heads != d_model {model.d_model}: "
                             "expected heads that tile the width")
        shapes = [(name, tuple(shape)) for name, shape, _ in parameter_shapes(model)]
        tensors = tuple(ParallelTensor(name, shape, family.tensor_parallel_dim(name, shape), place,
                                       ".mlp.experts." in name)
                        for (name, shape), place in zip(shapes, _places([name for name, _ in shapes])))
        moe = {}
        if design == "moe":                          # the MoE families keep their experts in ModelConfig.extra
            moe = dict(head_dim=model.head_dim, experts=model.setting("experts"), top_k=model.setting("top_k"),
                       expert_ffn=model.setting("expert_ffn"), normalize=model.setting("normalize"),
                       dense_layers=tuple(model.setting("dense_layers")))
        return cls(name=model.name, tensors=tensors, layers=model.num_layers, width=model.d_model,
                   heads=model.num_heads, kv_heads=model.kv_heads, ffn=model.ffn, vocab=model.vocab_size,
                   design=design, **moe)

    @classmethod
    def from_hf(cls, config: Any) -> "ParallelModel":
        """A transformers config (a ``PretrainedConfig``, a dict, a config.json path or a shipped name)."""
        from .from_transformers import model_config_from_hf
        return cls.from_config(model_config_from_hf(config))

    @classmethod
    def from_module(cls, module: Any, plan: Mapping[str, Any], *, heads: int, name: str = "module",
                    design: str = "gpt", experts: Sequence[str] = (), top_k: int = 0,
                    normalize: bool = True) -> "ParallelModel":
        """An ``nn.Module`` whose blocks ``plan`` (one block's ``parallelize_module`` plan) splits.

        Parameters inside ``layers.<i>.`` (or ``blocks.<i>.``, ``h.<i>.``: ``data_parallel``'s FSDP units) are layer
        ``i``, the plan's names relative to the block; a module with no such list is one layer, the plan's names
        relative to the module. ``ColwiseParallel`` splits a weight's dim 0 (and its bias), ``RowwiseParallel``
        its dim 1 (the bias stays whole); everything else is whole on every rank. The first layer's input is the
        batch (no embedding) and ``vocab`` is 0. ``experts`` names the parameters that stack experts (dim 0 one per
        expert, ``(E, 2F, C)`` then ``(E, C, F)``, as notebook 14's layer holds them), ``top_k`` the experts per
        token: a mixture of experts whose other matrices are dense layers (``expert_parallel.py``).
        """
        from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel
        named = [(n, tuple(p.shape)) for n, p in module.named_parameters()]
        units = [unit_of(n) for n, _ in named]
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
            tensors.append(ParallelTensor(full, shape, tp_dim, place, full in experts))
        layers = max(u for u in units) + 1 if stacked else 1
        if experts:                                   # (E, 2F, C): the experts' count, width and the stream's
            stack = next(shape for n, shape in named if n == experts[0])
            return cls(name=name, tensors=tuple(tensors), layers=layers, width=stack[2], heads=heads, kv_heads=heads,
                       ffn=stack[1] // 2, vocab=0, design="moe", embedded=False, experts=stack[0], top_k=top_k,
                       expert_ffn=stack[1] // 2, normalize=normalize)
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


def _places(names: Sequence[str]) -> list[int | str]:
    """Each parameter's layer (``data_parallel``'s FSDP unit), or the pipeline end it sits at."""
    units = [unit_of(name) for name in names]
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


