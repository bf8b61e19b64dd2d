"""Model parallelism in the calculator: tensor (and sequence), pipeline and context parallelism with data parallelism.

Introduced in notebook 13 (model parallelism), whose ranks measure on the CPU what this module predicts: the
bytes each rank holds, by category, when a model is split ``tp`` ways by tensor parallelism (the Megatron
layout, optionally with sequence parallelism), into ``pp`` pipeline stages (GPipe or 1F1B, with its micro-batches
in flight per stage), ``cp`` ways along the sequence (ring attention), and replicated or sharded over ``dp``
data-parallel ranks (DDP, ZeRO-1, ZeRO-2 or FSDP, as ``data_parallel.py`` and ``optimizers.py`` shard them).

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
    python -m utils.calculator --hf-config mixtral-8x7b --dp 8 --ep 8 --zero 3 --checkpointing every_block

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

import argparse
import functools
import itertools
import math
from typing import Any, Iterable, Sequence

from .config import TrainingSetup
from .expert_parallel import busiest_received_rows, moe_layer_saved_bytes
from .optimizers import ADAMW8BIT_CODEBOOKS, state_bytes
from .parallel_layout import (CATEGORIES, SCHEDULES, ZERO_LABELS, ZERO_STAGES, ParallelBreakdown,  # noqa: F401
                              ParallelLayout, StageBytes, bubble_fraction, layout_for_world,
                              micro_batches_in_flight, stage_layers)
from .parallel_tensors import ParallelModel, ParallelTensor, as_parallel_model  # noqa: F401  (notebook 13's names)
from .replay import _shard_numel

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
    if layout.ep > 1 and not model.experts:
        raise ValueError(f"ep = {layout.ep}: expert parallelism splits a mixture of experts' experts, and {model.name} "
                         "has none: expected ep=1")
    if model.experts and model.experts % layout.ep:
        raise ValueError(f"{model.experts} experts per layer cannot be split over ep = {layout.ep} ranks: expected an "
                         "ep that divides the experts")
    if setup.routing is not None and not model.experts:
        raise ValueError(f"routing is a mixture of experts' input, and {model.name} has no experts: expected None")
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


def layer_activation_bytes(model: ParallelModel, setup: TrainingSetup, layout: ParallelLayout,
                           moe: bool = False) -> dict[str, int]:
    """Bytes one layer keeps for backward for one micro-batch on one rank, by where they live.

    Per token (``C`` width, ``F`` MLP width, ``H`` heads, ``e`` bytes per element: 4 in fp32, 2 otherwise): the
    layer's input and mid-block residual (``2C``) and the norms' fp32 statistics (LayerNorm: mean and rstd, 2 per
    norm; RMSNorm: rstd) live outside the tensor-parallel region ("replicated"; "seq_sharded" 1/tp under sequence
    parallelism); the norms' outputs (``2C``, the inputs of q/k/v and of the MLP) too, but under sequence
    parallelism they are all-gathered and kept whole ("gathered": DTensor keeps the gathered input); q, k, v and
    the attention output (``gpt``: ``4C``; ``llama``: ``2C + 2·kv``), the attention's fp32 log-sum-exp (``H``),
    the MLP's hidden layers (``gpt``: ``2F``, before and after GELU; ``llama``: ``4F``, gate, up, SiLU(gate) and
    their product) are split 1/tp ("sharded"). Tokens are ``micro_batch · seq_len / cp``. For the course's block
    in fp32 (notebook 13) this is exact; for ``llama`` in bf16 it is a count, not measured. ``moe``: a mixture of
    experts' layer, whose attention is counted here and whose MoE layer ``expert_parallel.moe_layer_saved_bytes``
    counts (its input included).
    """
    e = 4 if setup.precision == "fp32" else 2
    tokens = setup.micro_batch * setup.seq_len // layout.cp
    c, f, h, tp = model.width, model.ffn, model.heads, layout.tp
    q = h * (model.head_dim or c // h)                           # the queries' and the attention output's width
    kv = model.kv_heads * (q // h)
    stats = 2 * 2 * 4 if model.design == "gpt" else 2 * 4
    inner = (4 * c + 2 * f) * e if model.design == "gpt" else (2 * q + 2 * kv + 4 * f) * e
    norm_outputs = tokens * 2 * c * e
    if moe:                  # an MoE layer: the attention alone here (the MoE layer keeps its own input, counted apart)
        inner, norm_outputs = (2 * q + 2 * kv) * e, tokens * c * e
    sharded = tokens * (inner + h * 4) // tp
    stream = tokens * (2 * c * e + stats)
    if tp > 1 and layout.sequence_parallel:
        parts = {"replicated": 0, "sharded": sharded, "seq_sharded": stream // tp, "gathered": norm_outputs}
    else:
        parts = {"replicated": stream + norm_outputs, "sharded": sharded, "seq_sharded": 0, "gathered": 0}
    return parts | {"total": sum(parts.values())}


def _local_shape(tensor: ParallelTensor, tp: int, ep: int = 1) -> tuple[int, ...]:
    shape = list(tensor.shape)
    if tensor.expert:                                           # expert parallelism: E / ep experts on each rank
        shape[0] //= ep
    if tensor.tp_dim is not None and tp > 1:
        shape[tensor.tp_dim] //= tp
    return tuple(shape)


def _optimizer_bytes(shapes: Sequence[tuple[int, ...]], setup: TrainingSetup) -> tuple[int, int]:
    """(per-element state bytes, step counters' bytes) of torch.optim for these tensors, as optimizers.py counts."""
    total = state_bytes(list(shapes), setup.optimizer)
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
    """Parameters, gradients, optimizer state of one GPU's tensors: tp shards, then ``data_parallel``'s ZeRO rules
    (FSDP2's padded dim-0 shards, ZeRO-2's flat gradient partitions, ZeRO-1/2's flat 1/N of the optimizer state)."""
    totals = [0, 0, 0, 0]
    # the experts (E / ep of them) are replicated, or ZeRO-sharded, over the dp / ep copies of each expert rank
    dp_experts = layout.dp // layout.ep
    strategy_experts = ZERO_STAGES[layout.zero] if dp_experts > 1 else "single"
    for experts in (False, True):
        dp, strategy = (dp_experts, strategy_experts) if experts else (layout.dp, layout.strategy)
        part = [0, 0, 0, 0]
        for group in groups:
            shapes = tuple(_local_shape(t, layout.tp, layout.ep) for t in group if t.expert == experts)
            if shapes:
                for i, value in enumerate(_group_state(shapes, setup, dp, strategy)):
                    part[i] += value
        if strategy in ("zero1", "zero2"):                       # a flat 1/N of the state; the counters by tensor
            part[2], part[3] = math.ceil(part[2] / dp), 4 * math.ceil(part[3] // 4 / dp)
        totals = [a + b for a, b in zip(totals, part)]
    parameters, gradients, elements, steps = totals
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
    per_layer_total = dict.fromkeys(range(model.layers), layer["total"])
    received = 0
    if model.experts:                  # a mixture of experts: the busiest expert-parallel rank's MoE layers
        received = busiest_received_rows(model, tokens, layout.ep, _layer_routing(setup.routing))
        attention = layer_activation_bytes(model, setup, layout, moe=True)["total"]
        moe = attention + moe_layer_saved_bytes(model, tokens, tokens * model.top_k, received, e, layout.tp)
        per_layer_total = {i: layer["total"] if i in model.dense_layers else moe for i in range(model.layers)}
    stream_split = layout.tp if layout.tp > 1 and layout.sequence_parallel else 1
    hidden = tokens * model.width * e // stream_split            # one (B, L, C) activation on this rank
    checkpointed = setup.checkpointing == "every_block"
    # Llama's rotary embedding keeps its inv_freq buffer (head_dim / 2 fp32 values) on every stage, as the replay does
    rotary = (model.head_dim or model.width // model.heads) // 2 * 4 if model.design in ("llama", "moe") else 0
    by_place: dict[int | str, list[ParallelTensor]] = {}
    for tensor in model.tensors:
        by_place.setdefault(tensor.place, []).append(tensor)
    stages = []
    for s, layers in enumerate(stage_layers(model.layers, layout.pp)):
        first, last = s == 0, s == layout.pp - 1
        places = [*(["first"] if first else []), *layers, *(["last"] if last else [])]
        terms = dict.fromkeys(CATEGORIES, 0) | _model_state([by_place.get(p, []) for p in places], setup, layout)
        terms["parameters"] += rotary
        one = sum(hidden if checkpointed else per_layer_total[i] for i in layers) - (
            hidden if first and not model.embedded else 0)
        in_flight = micro_batches_in_flight(s, layout.pp, layout.m, layout.schedule)
        terms["activations"] = in_flight * one + (max(per_layer_total[i] for i in layers) if checkpointed else 0)
        if first:
            terms["inputs"] = 2 * tokens * 8 if model.embedded else hidden   # token ids and targets, or the batch
        # the last stage keeps each micro-batch's loss input until that micro-batch's backward: the logits (split by
        # loss_parallel) and their fp32 log-softmax, or the last hidden state a regression loss saves
        loss_one = (tokens * model.vocab * (e + 4) // layout.tp if model.vocab else hidden) if last else 0
        terms["loss"] = in_flight * loss_one
        sharded_experts = layout.dp // layout.ep > 1                 # resident experts are not gathered
        layer_numel = [sum(math.prod(_local_shape(t, layout.tp, layout.ep)) for t in by_place.get(i, [])
                           if not t.expert or sharded_experts) for i in layers]
        two_layers = sum(sorted(layer_numel)[-2:])
        if layout.strategy == "fsdp":
            terms["comm_buffers"] = two_layers * (2 if setup.precision != "fp32" else item)
        elif layout.strategy in ("ddp", "zero1"):
            terms["comm_buffers"] = terms["gradients"]
        if setup.precision == "bf16-autocast" and layout.strategy != "fsdp":
            terms["weight_copies"] = two_layers * 2
        if layout.ep > 1 and any(i not in model.dense_layers for i in layers):   # one all-to-all's rows at a time
            terms["comm_buffers"] += (tokens * model.top_k + received) * model.width * e
        stages.append(StageBytes(stage=s, layers=layers, in_flight=in_flight, terms=terms,
                                 one_micro_batch_activations=one + loss_one))
    kv = 2 * tokens * model.kv_heads * (model.head_dim or model.width // model.heads) * e // layout.tp
    details = {"layer activations": layer, "keys and values per layer": kv,
               "bubble": bubble_fraction(layout.pp, layout.m)}
    if model.experts:
        details["received rows (busiest expert rank)"] = received
    return ParallelBreakdown(model=model, setup=setup, layout=layout, stages=tuple(stages), details=details)


def _layer_routing(routing: Any) -> Any:
    """TrainingSetup.routing as expert parallelism reads it: every rank routes its micro-batch alike; per MoE layer
    (a tuple per layer), the busiest layer's (the one whose busiest rank receives the most)."""
    if routing is None or routing == "balanced" or isinstance(routing[0], int):
        return routing
    return max(routing, key=lambda counts: max(counts))


# --- searching and printing ----------------------------------------------------------------------------------------

def candidate_layouts(max_gpus: int = 4096, tp_degrees: Sequence[int] = (1, 2, 4, 8),
                      pp_degrees: Sequence[int] = (1, 2, 4, 8, 16), cp_degrees: Sequence[int] = (1, 2, 4),
                      zero_stages: Sequence[int] = (0, 1, 3), ep_degrees: Sequence[int] = (1,),
                      **options: Any) -> list[ParallelLayout]:
    """Every layout with power-of-two data-parallel degrees up to ``max_gpus`` GPUs (tp within one 8-GPU node), and
    each expert-parallel degree of ``ep_degrees`` that divides its dp (a mixture of experts)."""
    layouts = []
    for tp, pp, cp, zero in itertools.product(tp_degrees, pp_degrees, cp_degrees, zero_stages):
        dp = 1
        while dp * tp * pp * cp <= max_gpus:
            if zero == 0 or dp > 1:
                layouts += [ParallelLayout(tp=tp, pp=pp, cp=cp, dp=dp, zero=zero, ep=ep, **options)
                            for ep in ep_degrees if dp % ep == 0]
            dp *= 2
    return layouts


def smallest_fitting_layout(model: Any, setup: TrainingSetup, device_bytes: float, *,
                            layouts: Iterable[ParallelLayout] | None = None) -> ParallelBreakdown | None:
    """The layout with the fewest GPUs whose busiest GPU fits ``device_bytes`` (ties: the least memory per GPU).

    Layouts the model or the sequence cannot be split into are skipped; None when nothing fits. A mixture of experts
    is also tried with every power-of-two expert-parallel degree that divides its experts.
    """
    model = as_parallel_model(model)
    if layouts is None and model.experts:
        layouts = candidate_layouts(ep_degrees=[2 ** i for i in range(model.experts.bit_length())
                                                if model.experts % 2 ** i == 0])
    by_gpus: dict[int, list[ParallelLayout]] = {}
    for layout in layouts if layouts is not None else candidate_layouts():
        by_gpus.setdefault(layout.gpus, []).append(layout)
    # every GPU's model state together is at least one copy's, so the busiest holds at least 1/gpus of it
    floor = sum(_model_state([model.tensors], setup, ParallelLayout()).values())
    for gpus in sorted(by_gpus):                 # the fewest GPUs first: stop at the first count where one fits
        if floor / gpus > device_bytes:
            continue
        fitting = []
        for layout in by_gpus[gpus]:
            try:
                breakdown = predict_parallel(model, setup, layout)
            except ValueError:
                continue
            if breakdown.fits(device_bytes):
                fitting.append(breakdown)
        if fitting:
            return min(fitting, key=lambda breakdown: breakdown.total)
    return None


TERM_LABELS = {"parameters": "parameters", "gradients": "gradients", "optimizer_state": "optimizer state",
               "activations": "activations (in flight)", "loss": "loss and logits", "weight_copies": "bf16 weight copies",
               "comm_buffers": "gathered layers / buckets", "inputs": "batch"}


def format_parallel(breakdown: ParallelBreakdown, device_bytes: float | None = None) -> str:
    """A table: each stage's GPU by category, in GB (10^9 bytes), and the fit verdict."""
    layout, setup = breakdown.layout, breakdown.setup
    lines = [f"{breakdown.model.name}: {layout.label()} = {layout.gpus} GPUs; {layout.schedule} with {layout.m} "
             f"micro-batches of {setup.micro_batch} x {setup.seq_len} tokens; {setup.precision}, {setup.optimizer}, "
             f"checkpointing {setup.checkpointing}"
             + ("; sequence parallel" if layout.tp > 1 and layout.sequence_parallel else ""),
             f"{'stage':<28}" + "".join(f"{stage.stage:>10}" for stage in breakdown.stages)]
    for key, label in TERM_LABELS.items():
        lines.append(f"{label:<28}" + "".join(f"{stage.terms[key] / 1e9:>10.2f}" for stage in breakdown.stages))
    lines.append(f"{'total (GB per GPU)':<28}" + "".join(f"{stage.total / 1e9:>10.2f}" for stage in breakdown.stages))
    lines.append(f"{'micro-batches in flight':<28}" + "".join(f"{stage.in_flight:>10}" for stage in breakdown.stages))
    busiest = breakdown.busiest
    verdict = f"busiest GPU: stage {busiest.stage}, {busiest.total / 1e9:.2f} GB"
    if device_bytes:
        verdict += f" of {device_bytes / 1e9:.0f} GB: {'fits' if breakdown.fits(device_bytes) else 'does not fit'}"
    lines.append(verdict + f"; pipeline bubble {breakdown.details['bubble']:.1%}")
    return "\n".join(lines)


# --- the command line (wired into python -m utils.calculator) -------------------------------------------------

def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add ``--tp --pp --cp --dp --ep --zero --schedule --micro-batches --no-sequence-parallel`` to the calculator's
    parser."""
    group = parser.add_argument_group("model parallelism (any of these switches to the per-stage prediction)")
    group.add_argument("--tp", type=int, default=1, help="tensor-parallel degree (default 1)")
    group.add_argument("--pp", type=int, default=1, help="pipeline stages (default 1)")
    group.add_argument("--cp", type=int, default=1, help="context-parallel degree (default 1)")
    group.add_argument("--dp", type=int, default=1, help="data-parallel replicas (default 1)")
    group.add_argument("--ep", type=int, default=1,
                       help="expert-parallel degree, taken from --dp (a mixture of experts: E / ep experts per GPU)")
    group.add_argument("--zero", type=int, choices=sorted(ZERO_STAGES), default=0,
                       help="with --dp: 0 DDP, 1 ZeRO-1, 2 ZeRO-2, 3 FSDP (default 0)")
    group.add_argument("--schedule", choices=SCHEDULES, default="1f1b", help="pipeline schedule (default 1f1b)")
    group.add_argument("--micro-batches", type=int, default=None, help="micro-batches per step (default: --pp)")
    group.add_argument("--no-sequence-parallel", action="store_true",
                       help="with --tp: keep the norms and residual stream whole on every rank")


def wants_model_parallel(args: argparse.Namespace) -> bool:
    """Whether the command line asked for any model-parallel flag (``cli.main`` then calls ``run``)."""
    return (args.tp, args.pp, args.cp, args.dp, args.ep, args.zero, args.schedule, args.micro_batches,
            args.no_sequence_parallel) != (1, 1, 1, 1, 1, 0, "1f1b", None, False)


def run(args: argparse.Namespace) -> str:
    """The report of ``python -m utils.calculator ... --tp/--pp/--cp/--dp``: the per-stage table and the verdict.

    Uses the calculator's own flags for the model (``--hf-config``, ``--preset`` or a shape) and the training
    set-up (``--micro-batch``, ``--seq-len``, ``--precision``, ``--optimizer``, ``--impl``, ``--checkpointing``,
    ``--device``, ``--device-gb``); data parallelism is ``--dp`` and ``--zero``, not ``--strategy``/``--ranks``.

    Raises:
        ValueError: a layout or set-up this module refuses (``cli.main`` turns it into a usage error).
    """
    from .presets import model_from_args
    if getattr(args, "strategy", "single") != "single" or getattr(args, "ranks", 1) != 1:
        raise ValueError("with --tp/--pp/--cp/--dp, data parallelism is --dp and --zero: expected no --strategy or "
                         "--ranks")

    class _Refuse:
        @staticmethod
        def error(message: str) -> None:
            raise ValueError(message)

    model = model_from_args(args, _Refuse().error)
    impl = getattr(args, "impl", None) or ("for-loop" if args.optimizer == "adamw8bit" else "foreach")
    setup = TrainingSetup(micro_batch=args.micro_batch, seq_len=args.seq_len, precision=args.precision,
                          optimizer=args.optimizer, optimizer_impl=impl, checkpointing=args.checkpointing,
                          device=args.device, routing=getattr(args, "routing_value", None))
    layout = ParallelLayout(tp=args.tp, pp=args.pp, cp=args.cp, dp=args.dp, zero=args.zero, schedule=args.schedule,
                            micro_batches=args.micro_batches, sequence_parallel=not args.no_sequence_parallel,
                            ep=args.ep)
    device_bytes = args.device_gb * 1e9 if getattr(args, "device_gb", 0) else None
    return format_parallel(predict_parallel(model, setup, layout), device_bytes)
