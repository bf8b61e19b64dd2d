"""Model parallelism in the calculator: tensor (and sequence), pipeline and context parallelism with data parallelism.

Introduced in notebook 13 (model parallelism), whose ranks measure on the CPU what this module predicts: the
bytes each rank holds, by category, when a model is split ``tp`` ways by tensor parallelism (the Megatron
layout, optionally with sequence parallelism), into ``pp`` pipeline stages (GPipe or 1F1B, with its micro-batches
in flight per stage), ``cp`` ways along the sequence (ring attention), and replicated or sharded over ``dp``
data-parallel ranks (DDP, ZeRO-1, ZeRO-2 or FSDP, as ``dataparallel.py`` and ``optimizers.py`` shard them).

What a model is here: its parameter tensors, each with the dimension tensor parallelism splits
(``ParallelTensor``), and the shape of one layer's activations (``ParallelModel``). ``ParallelModel.from_config``
reads a calculator ``ModelConfig`` (``"gpt"``, ``"llama"``, ``"hf-llama"``: matrices column- or row-parallel, the
embedding and the head split over the vocabulary, norms and position table whole); ``from_hf`` a transformers
config (``load_hf_config``, a shipped name, a path or a dict); ``from_module`` an ``nn.Module`` and the
``parallelize_module`` plan of one of its blocks (``ColwiseParallel``: dim 0, ``RowwiseParallel``: dim 1 of the
weight, the rest whole), which is how notebook 13 describes the model its ranks train.

``predict_parallel(model, setup, layout)`` returns a ``ParallelBreakdown``: for every pipeline stage the bytes one
GPU of that stage holds at its peak (parameters, gradients, optimizer state, activations, loss, weight copies,
communication buffers, inputs), and the busiest stage's. On the command line (wired into ``python -m
utils.calculator`` by ``add_arguments`` and ``run``)::

    python -m utils.calculator --hf-config llama-2-70b --tp 8 --pp 4 --dp 2 --zero 1 --schedule 1f1b --micro-batches 16

Exactness. On the CPU, in fp32, the model-state terms (parameters, gradients, AdamW's state and step counters,
FSDP2's dim-0 shards, tensor-parallel shards, a stage's layers), the activations of the course's block under
tensor and sequence parallelism, each pipeline stage's activations under GPipe and 1F1B, and the key/value bytes
per context-parallel rank equal what notebook 13's ranks measure, to the byte (the notebook asserts it; its
ranks' figures are in ``tests/test_calculator_model_parallel.py``). Not measured here (no GPU): the activations of
the Llama design in bf16 (a per-token count in the style of Korthikanti et al. 2022, with sequence parallelism
keeping the all-gathered norm outputs whole, as DTensor does), the logits and their fp32 loss on the last stage,
FSDP's gathered layers, DDP's gradient buckets. Mixed precision (``"bf16-autocast"``) keeps fp32 weights,
gradients and optimizer state (16 bytes per parameter with AdamW, as the single-GPU calculator) and bf16 copies of
the two layers being computed (FSDP2's ``MixedPrecisionPolicy``, Megatron); plain ``torch.autocast`` keeps a copy of
every weight until its backward (the single-GPU calculator's ``weight_copies``), not modelled here.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field
from typing import Any, Sequence

from ..checks import positive_int
from ..footprint import predict_optimizer_state_bytes
from .config import TrainingSetup
from .dataparallel import _shard_numel
from .optimizers import ADAMW8BIT_CODEBOOKS

SCHEDULES = ("gpipe", "1f1b")
ZERO_STAGES = {0: "ddp", 1: "zero1", 2: "zero2", 3: "fsdp"}     # the data-parallel strategies of TrainingSetup
ZERO_LABELS = {0: "DDP", 1: "ZeRO-1", 2: "ZeRO-2", 3: "FSDP"}
CATEGORIES = ("parameters", "gradients", "optimizer_state", "activations", "loss", "weight_copies", "comm_buffers",
              "inputs")



# --- the layout ------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class ParallelLayout:
    """How the GPUs are used: ``dp · tp · pp · cp`` of them.

    Attributes:
        tp: tensor-parallel degree (the heads, the MLP's hidden units and the vocabulary split ``tp`` ways).
        pp: pipeline stages (contiguous layers each; the embedding on the first, the final norm and head on the last).
        cp: context-parallel degree (the sequence split ``cp`` ways inside attention: ring attention).
        dp: data-parallel ranks, replicating (``zero=0``, DDP) or sharding (``zero`` 1, 2, 3 = FSDP) the model state.
        zero: 0 (DDP), 1 (optimizer state sharded), 2 (and gradients), 3 (FSDP: parameters too).
        sequence_parallel: with ``tp > 1``, the norms and residual stream split along the sequence.
        schedule: ``"1f1b"`` or ``"gpipe"``.
        micro_batches: micro-batches per step through the pipeline (None: ``pp``, the fewest 1F1B runs with).

    Raises:
        ValueError: non-positive degrees, an unknown ZeRO stage or schedule, fewer micro-batches than stages.
    """

    tp: int = 1
    pp: int = 1
    cp: int = 1
    dp: int = 1
    zero: int = 0
    sequence_parallel: bool = True
    schedule: str = "1f1b"
    micro_batches: int | None = None

    def __post_init__(self) -> None:
        for name in ("tp", "pp", "cp", "dp"):
            positive_int(name, getattr(self, name))
        if self.zero not in ZERO_STAGES:
            raise ValueError(f"zero must be one of {tuple(ZERO_STAGES)}: expected 0 (DDP), 1 or 2 (ZeRO) or 3 (FSDP), "
                             f"got {self.zero!r}")
        if self.schedule not in SCHEDULES:
            raise ValueError(f"schedule must be one of {SCHEDULES}, got {self.schedule!r}")
        if not isinstance(self.sequence_parallel, bool):
            raise ValueError(f"sequence_parallel must be True or False, got {self.sequence_parallel!r}")
        if self.micro_batches is not None:
            positive_int("micro_batches", self.micro_batches)
            if self.schedule == "1f1b" and self.micro_batches < self.pp:
                raise ValueError(f"{self.micro_batches} micro-batches for {self.pp} stages: 1F1B expects at least as "
                                 f"many micro-batches as stages (expected >= {self.pp})")

    @property
    def gpus(self) -> int:
        """dp · tp · pp · cp."""
        return self.dp * self.tp * self.pp * self.cp

    @property
    def m(self) -> int:
        """Micro-batches per step."""
        return self.micro_batches if self.micro_batches is not None else self.pp

    @property
    def strategy(self) -> str:
        """The data-parallel part as ``TrainingSetup.strategy`` names it (``"single"`` with one replica)."""
        return ZERO_STAGES[self.zero] if self.dp > 1 else "single"

    def label(self) -> str:
        """e.g. ``dp2 (ZeRO-1) × tp8 × pp4 × cp2``."""
        parts = [f"dp{self.dp} ({ZERO_LABELS[self.zero]})"] if self.dp > 1 else []
        parts += [f"{name}{degree}" for name, degree in (("tp", self.tp), ("pp", self.pp), ("cp", self.cp))
                  if degree > 1]
        return " × ".join(parts) or "one GPU"


def layout_for_world(world_size: int, *, tp: int = 1, pp: int = 1, cp: int = 1, zero: int = 0,
                     **options: Any) -> ParallelLayout:
    """The layout of ``world_size`` GPUs with these model-parallel degrees; data parallelism takes the rest.

    Raises:
        ValueError: a world size that ``tp · pp · cp`` does not divide (the message lists the sizes that would).
    """
    positive_int("world_size", world_size)
    model_parallel = positive_int("tp", tp) * positive_int("pp", pp) * positive_int("cp", cp)
    if world_size % model_parallel:
        options_text = ", ".join(str(model_parallel * k) for k in range(1, 5))
        raise ValueError(f"a world of {world_size} GPUs cannot be made of tp·pp·cp = {tp}·{pp}·{cp} = "
                         f"{model_parallel}-GPU replicas: expected a world size divisible by {model_parallel} "
                         f"(e.g. {options_text})")
    return ParallelLayout(tp=tp, pp=pp, cp=cp, dp=world_size // model_parallel, zero=zero, **options)


from .parallel_model import ParallelModel, ParallelTensor, as_parallel_model  # noqa: E402,F401  (re-exported)
from .parallel_model import DESIGNS, _COLUMN, _ROW, _VOCAB, _inside_block, _places, _tp_dim_by_name  # noqa: E402,F401,E501  (re-exported)

# --- checks ------------------------------------------------------------------------------------------------------

def check_layout(model: ParallelModel, setup: TrainingSetup, layout: ParallelLayout) -> None:
    """Every split the layout asks for must be whole: a ValueError naming what was expected otherwise."""
    tp = layout.tp
    for what, size in (("width", model.width), ("heads", model.heads), ("key/value heads", model.kv_heads),
                       ("ffn", model.ffn), ("vocab", model.vocab)):
        if size and size % tp:
            raise ValueError(f"{what} = {size} is not divisible by the tensor-parallel degree tp = {tp}: expected a tp "
                             f"that divides the width ({model.width}), the heads ({model.heads}), the key/value heads "
                             f"({model.kv_heads}), the MLP width ({model.ffn})"
                             + (f" and the vocabulary ({model.vocab})" if model.vocab else ""))
    for tensor in model.tensors:
        if tensor.tp_dim is not None and tensor.shape[tensor.tp_dim] % tp:
            raise ValueError(f"{tensor.name} {tensor.shape}: dim {tensor.tp_dim} is not divisible by tp = {tp}: expected "
                             "a tp that divides every split dimension")
    if layout.pp > model.layers:
        raise ValueError(f"{layout.pp} pipeline stages for {model.layers} layers: expected at most one stage per layer "
                         f"(pp <= {model.layers})")
    tokens = setup.seq_len
    if tokens % (2 * layout.cp):
        raise ValueError(f"a sequence of {tokens} tokens cannot be split over cp = {layout.cp} ranks: expected a length "
                         f"divisible by 2·cp = {2 * layout.cp} (two chunks per rank for the load-balanced causal split)")
    if layout.tp > 1 and layout.sequence_parallel and (tokens // layout.cp) % layout.tp:
        raise ValueError(f"{tokens // layout.cp} tokens per context-parallel rank are not divisible by tp = {layout.tp}: "
                         "sequence parallelism splits them between the blocks, so expected a multiple of tp")
    if setup.strategy != "single":
        raise ValueError(f"data parallelism is the layout's dp and zero here: expected TrainingSetup(strategy='single'),"
                         f" got strategy {setup.strategy!r}")
    if setup.lora_rank:
        raise ValueError("LoRA with model parallelism is not modelled: expected lora_rank=0")
    if setup.checkpointing == "selective":
        raise ValueError("selective checkpointing is not modelled with model parallelism: expected checkpointing "
                         "'none' or 'every_block'")
    others = {"accumulation_steps": (setup.accumulation_steps, 1), "base_quant": (setup.base_quant, "none"),
              "fp8": (setup.fp8, False), "bf16_rounding": (setup.bf16_rounding, "nearest")}
    changed = [f"{name}={value!r}" for name, (value, default) in others.items() if value != default]
    if changed:
        raise ValueError(f"{', '.join(changed)}: not modelled with model parallelism (the pipeline's micro-batches are "
                         "its accumulation): expected the TrainingSetup defaults")
    if setup.chunked_loss:
        raise ValueError("a chunked loss is not modelled with model parallelism (loss_parallel splits the logits "
                         "instead): expected chunked_loss=0")


# --- the prediction --------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class StageBytes:
    """One pipeline stage's GPU: its layers, micro-batches in flight at the peak, and bytes by category.

    ``one_micro_batch_activations`` is what one micro-batch leaves saved for backward on this stage: its layers'
    activations (less the batch itself on the first stage of a model without an embedding) and, on the last
    stage, the loss's input; the stage keeps ``in_flight`` of them at its peak (``activations`` + ``loss``).
    """

    stage: int
    layers: tuple[int, ...]
    in_flight: int
    terms: dict[str, int]
    one_micro_batch_activations: int

    @property
    def total(self) -> int:
        """The sum of the terms."""
        return sum(self.terms.values())


@dataclass(frozen=True)
class ParallelBreakdown:
    """What ``predict_parallel`` returns.

    Attributes:
        model, setup, layout: what was predicted.
        stages: every stage's ``StageBytes`` (a GPU of that stage, any tensor-, context- or data-parallel rank).
        busiest: the stage whose GPU needs the most.
        details: per-layer figures the notebook compares with its ranks: ``"layer activations"`` (one layer, one
            micro-batch, by kind: replicated, sharded, seq_sharded, gathered), ``"keys and values per layer"``.
    """

    model: ParallelModel
    setup: TrainingSetup
    layout: ParallelLayout
    stages: tuple[StageBytes, ...]
    details: dict[str, Any] = field(default_factory=dict)

    @property
    def busiest(self) -> StageBytes:
        """The stage with the largest total (the first of equals)."""
        return max(self.stages, key=lambda stage: (stage.total, -stage.stage))

    @property
    def total(self) -> int:
        """Bytes on the busiest GPU."""
        return self.busiest.total

    def terms(self) -> dict[str, int]:
        """The busiest GPU's bytes by category."""
        return dict(self.busiest.terms)

    def fits(self, device_bytes: float) -> bool:
        """Whether the busiest GPU needs at most ``device_bytes``."""
        return self.total <= device_bytes


def stage_layers(layers: int, pp: int) -> list[tuple[int, ...]]:
    """The layers of each stage: contiguous, as even as possible, the later stages taking the remainder."""
    positive_int("layers", layers)
    positive_int("pp", pp)
    if pp > layers:
        raise ValueError(f"{pp} pipeline stages for {layers} layers: expected at most one stage per layer")
    return [tuple(range(layers * s // pp, layers * (s + 1) // pp)) for s in range(pp)]


def micro_batches_in_flight(stage: int, stages: int, micro_batches: int, schedule: str = "1f1b") -> int:
    """Micro-batches whose activations a stage holds at its peak: GPipe all ``m``; 1F1B ``min(m, p − stage)``."""
    positive_int("stages", stages)
    positive_int("micro_batches", micro_batches)
    if not 0 <= stage < stages:
        raise ValueError(f"stage must be in 0..{stages - 1}, got {stage!r}")
    if schedule not in SCHEDULES:
        raise ValueError(f"schedule must be one of {SCHEDULES}, got {schedule!r}")
    return micro_batches if schedule == "gpipe" else min(micro_batches, stages - stage)


def bubble_fraction(stages: int, micro_batches: int) -> float:
    """The idle fraction of GPipe and 1F1B with equal forward and backward times: (p − 1) / (m + p − 1)."""
    positive_int("stages", stages)
    positive_int("micro_batches", micro_batches)
    return (stages - 1) / (micro_batches + stages - 1)


def layer_activation_bytes(model: ParallelModel, setup: TrainingSetup, layout: ParallelLayout) -> dict[str, int]:
    """Bytes one layer keeps for backward for one micro-batch on one rank, by where they live.

    Per token (``C`` width, ``F`` MLP width, ``H`` heads, ``e`` bytes per element: 4 in fp32, 2 otherwise): the
    layer's input and mid-block residual (``2C``) and the norms' fp32 statistics (LayerNorm: mean and rstd, 2 per
    norm; RMSNorm: rstd) live outside the tensor-parallel region ("replicated"; "seq_sharded" 1/tp under sequence
    parallelism); the norms' outputs (``2C``, the inputs of q/k/v and of the MLP) too, but under sequence
    parallelism they are all-gathered and kept whole ("gathered": DTensor keeps the gathered input); q, k, v and
    the attention output (``gpt``: ``4C``; ``llama``: ``2C + 2·kv``), the attention's fp32 log-sum-exp (``H``),
    the MLP's hidden layers (``gpt``: ``2F``, before and after GELU; ``llama``: ``4F``, gate, up, SiLU(gate) and
    their product) are split 1/tp ("sharded"). Tokens are ``micro_batch · seq_len / cp``. For the course's block
    in fp32 (notebook 13) this is exact; for ``llama`` in bf16 it is a count, not measured.
    """
    e = 4 if setup.precision == "fp32" else 2
    tokens = setup.micro_batch * setup.seq_len // layout.cp
    c, f, h, tp = model.width, model.ffn, model.heads, layout.tp
    kv = model.kv_heads * (c // model.heads)
    stats = 2 * 2 * 4 if model.design == "gpt" else 2 * 4
    inner = (4 * c + 2 * f) * e if model.design == "gpt" else (2 * c + 2 * kv + 4 * f) * e
    sharded = tokens * (inner + h * 4) // tp
    stream, norm_outputs = tokens * (2 * c * e + stats), tokens * 2 * c * e
    if tp > 1 and layout.sequence_parallel:
        parts = {"replicated": 0, "sharded": sharded, "seq_sharded": stream // tp, "gathered": norm_outputs}
    else:
        parts = {"replicated": stream + norm_outputs, "sharded": sharded, "seq_sharded": 0, "gathered": 0}
    return parts | {"total": sum(parts.values())}


def _local_shape(tensor: ParallelTensor, tp: int) -> tuple[int, ...]:
    if tensor.tp_dim is None or tp == 1:
        return tensor.shape
    shape = list(tensor.shape)
    shape[tensor.tp_dim] //= tp
    return tuple(shape)


def _optimizer_bytes(shapes: Sequence[tuple[int, ...]], setup: TrainingSetup) -> tuple[int, int]:
    """(per-element state bytes, step counters' bytes) of torch.optim for these tensors, as optimizers.py counts."""
    total = predict_optimizer_state_bytes(shapes, setup.optimizer)
    steps = 4 * len(shapes) if setup.optimizer in ("adam", "adamw", "adafactor") else 0
    elements = total - steps
    if setup.precision == "bf16" and setup.optimizer != "adamw8bit":
        elements //= 2                          # torch.optim keeps its state in the parameters' dtype
    if setup.device == "cuda" and setup.optimizer_impl != "fused":
        steps = 0                               # `step` lives on the host unless fused or capturable
    return elements, steps


@functools.lru_cache(maxsize=4096)
def _group_state(shapes: tuple[tuple[int, ...], ...], setup: TrainingSetup, dp: int, strategy: str) -> tuple[int, ...]:
    """(parameter, gradient, optimizer-element and step-counter bytes) of these local tensors on one data-parallel
    rank, before ZeRO-1/2's flat division of the optimizer state (which applies to the whole stage)."""
    item = 2 if setup.precision == "bf16" else 4
    if strategy == "fsdp":                                       # FSDP2: dim 0 of every tensor, padded
        parameters = sum(_shard_numel(shape, dp) for shape in shapes) * item
        shards = [(math.ceil(shape[0] / dp),) + shape[1:] if shape else shape for shape in shapes]
        return (parameters, parameters, *_optimizer_bytes(shards, setup))
    parameters = sum(math.prod(shape) for shape in shapes) * item
    gradients = sum(math.ceil(math.prod(shape) * item / dp) for shape in shapes) if strategy == "zero2" else parameters
    return (parameters, gradients, *_optimizer_bytes(shapes, setup))


def _model_state(groups: Sequence[Sequence[ParallelTensor]], setup: TrainingSetup,
                 layout: ParallelLayout) -> dict[str, int]:
    """Parameters, gradients, optimizer state of one GPU's tensors: tp shards, then ``dataparallel``'s ZeRO rules
    (FSDP2's padded dim-0 shards, ZeRO-2's flat gradient partitions, ZeRO-1/2's flat 1/N of the optimizer state)."""
    totals = [0, 0, 0, 0]
    for group in groups:
        shapes = tuple(_local_shape(t, layout.tp) for t in group)
        for i, value in enumerate(_group_state(shapes, setup, layout.dp, layout.strategy)):
            totals[i] += value
    parameters, gradients, elements, steps = totals
    if layout.strategy in ("zero1", "zero2"):                    # a flat 1/N of the state; the counters by tensor
        elements, steps = math.ceil(elements / layout.dp), 4 * math.ceil(steps // 4 / layout.dp)
    codebooks = 4 * sum(ADAMW8BIT_CODEBOOKS) if setup.optimizer == "adamw8bit" else 0   # once, on the optimizer
    return {"parameters": parameters, "gradients": gradients, "optimizer_state": elements + steps + codebooks}


def predict_parallel(model: Any, setup: TrainingSetup, layout: ParallelLayout) -> ParallelBreakdown:
    """Bytes per GPU, by category, for every pipeline stage of ``layout`` training ``model`` as ``setup`` says.

    Each stage's GPU holds: the model state of its layers (and the embedding on the first stage, the final norm
    and head on the last), split by tp and sharded by the data-parallel ZeRO stage; the activations of the
    micro-batches in flight (``micro_batches_in_flight``) at ``micro_batch · seq_len / cp`` tokens each (with
    ``checkpointing="every_block"`` only each layer's input, plus one layer's whole activations while it is
    recomputed); on the last stage, for each micro-batch in flight, the logits (split over the vocabulary by
    ``loss_parallel``) and their fp32 log-softmax, or, without a head, the regression loss's input; on the first stage the batch; under FSDP the two
    layers being gathered, under DDP and ZeRO-1 the gradient buckets; in mixed precision bf16 copies of two layers.

    Args:
        model: a ``ParallelModel``, a calculator ``ModelConfig``, or a transformers config (name, path, dict).
        setup: precision, optimizer, micro-batch, sequence length, checkpointing, device (strategy ``"single"``:
            data parallelism is ``layout.dp`` and ``layout.zero``).
        layout: the degrees.

    Returns:
        A ``ParallelBreakdown``.

    Raises:
        ValueError: a split that is not whole (width, heads or vocabulary by tp, layers by pp, the sequence by
            2·cp), or a set-up this module does not model; each message names what was expected.

    Example:
        >>> from utils.calculator import TrainingSetup
        >>> layout = ParallelLayout(tp=8, pp=4, dp=2, zero=1, micro_batches=16)
        >>> predict_parallel("llama-2-70b", TrainingSetup(seq_len=4096), layout).total / 1e9
    """
    model = as_parallel_model(model)
    if not isinstance(setup, TrainingSetup):
        raise TypeError(f"expected a utils.calculator.TrainingSetup, got {type(setup).__name__}")
    if not isinstance(layout, ParallelLayout):
        raise TypeError(f"expected a ParallelLayout, got {type(layout).__name__}")
    check_layout(model, setup, layout)
    e = 4 if setup.precision == "fp32" else 2
    item = 2 if setup.precision == "bf16" else 4
    tokens = setup.micro_batch * setup.seq_len // layout.cp
    layer = layer_activation_bytes(model, setup, layout)
    stream_split = layout.tp if layout.tp > 1 and layout.sequence_parallel else 1
    hidden = tokens * model.width * e // stream_split            # one (B, L, C) activation on this rank
    checkpointed = setup.checkpointing == "every_block"
    # Llama's rotary embedding keeps its inv_freq buffer (head_dim / 2 fp32 values) on every stage, as the replay does
    rotary = model.width // model.heads // 2 * 4 if model.design == "llama" else 0
    by_place: dict[int | str, list[ParallelTensor]] = {}
    for tensor in model.tensors:
        by_place.setdefault(tensor.place, []).append(tensor)
    stages = []
    for s, layers in enumerate(stage_layers(model.layers, layout.pp)):
        first, last = s == 0, s == layout.pp - 1
        places = [*(["first"] if first else []), *layers, *(["last"] if last else [])]
        terms = dict.fromkeys(CATEGORIES, 0) | _model_state([by_place.get(p, []) for p in places], setup, layout)
        terms["parameters"] += rotary
        per_layer = hidden if checkpointed else layer["total"]
        one = len(layers) * per_layer - (hidden if first and not model.embedded else 0)
        in_flight = micro_batches_in_flight(s, layout.pp, layout.m, layout.schedule)
        terms["activations"] = in_flight * one + (layer["total"] if checkpointed else 0)
        if first:
            terms["inputs"] = 2 * tokens * 8 if model.embedded else hidden   # token ids and targets, or the batch
        # the last stage keeps each micro-batch's loss input until that micro-batch's backward: the logits (split by
        # loss_parallel) and their fp32 log-softmax, or the last hidden state a regression loss saves
        loss_one = (tokens * model.vocab * (e + 4) // layout.tp if model.vocab else hidden) if last else 0
        terms["loss"] = in_flight * loss_one
        layer_numel = [sum(math.prod(_local_shape(t, layout.tp)) for t in by_place.get(i, [])) for i in layers]
        two_layers = sum(sorted(layer_numel)[-2:])
        if layout.strategy == "fsdp":
            terms["comm_buffers"] = two_layers * (2 if setup.precision != "fp32" else item)
        elif layout.strategy in ("ddp", "zero1"):
            terms["comm_buffers"] = terms["gradients"]
        if setup.precision == "bf16-autocast" and layout.strategy != "fsdp":
            terms["weight_copies"] = two_layers * 2
        stages.append(StageBytes(stage=s, layers=layers, in_flight=in_flight, terms=terms,
                                 one_micro_batch_activations=one + loss_one))
    kv = 2 * tokens * model.kv_heads * (model.width // model.heads) * e // layout.tp
    details = {"layer activations": layer, "keys and values per layer": kv,
               "bubble": bubble_fraction(layout.pp, layout.m)}
    return ParallelBreakdown(model=model, setup=setup, layout=layout, stages=tuple(stages), details=details)


from .model_parallel_cli import add_arguments, candidate_layouts, format_parallel, run, smallest_fitting_layout  # noqa: E402,F401,E501
from .model_parallel_cli import wants_model_parallel  # noqa: E402,F401
