"""A step-time model for choosing a parallel layout: compute, the pipeline bubble and what each link carries.

Introduced in notebook 13 (model parallelism, section 5). The calculator (``utils.calculator.model_parallel``)
says which layouts *fit* a GPU's memory; this module says which of them trains *fastest*, for a fixed number of
GPUs and a fixed global batch, so that a layout is chosen by the time a step takes with memory as the
constraint (as Llama 3's was), not by the fewest GPUs. Every constant is a stated input (``Hardware``, with its
source); every term is a formula the notebook prints:

* **compute**: a training token costs ``6 N`` FLOPs in the matrices (``N`` the parameters that multiply, the head
  included, the input embedding not) plus ``6 · layers · seq · width`` in causal attention; checkpointing every
  block adds one more forward (``2 N``, ``2 · layers · seq · width``). A rank computes ``1 / (tp · cp)`` of each of
  its layers for each micro-batch at the stated peak (an upper bound: real kernels reach a fraction of it); its
  layers are those of the busiest pipeline rank, ``ceil(layers / (pp · v))`` per stage (the head spread over them).
* **the bubble**: the pipeline runs ``m + (p - 1) / v`` micro-batch slots for ``m`` micro-batches of work (1F1B and
  GPipe ``v = 1``; interleaved with ``v`` stages per rank), each slot one stage's compute and exposed traffic for one
  micro-batch (``utils.pipeline_schedules`` checks the share ``(p - 1) / (v m + p - 1)`` against torch's orders).
* **tensor parallelism**: per layer and micro-batch two all-reduces forward, two backward, two more in the
  recomputed forward (with sequence parallelism all-gathers and reduce-scatters, the same bytes), each of one bf16
  activation ``b · seq / cp · width``; a ring moves ``2 (tp - 1) / tp`` of it, over NVLink inside a node, else over
  the network. On the critical path: exposed.
* **context parallelism** (Llama 3's all-gathered keys and values): per layer an all-gather of K and V forward (and
  in the recomputed forward), a reduce-scatter of their gradients backward; exposed.
* **pipeline sends**: one activation forward and one gradient backward per micro-batch and stage boundary; exposed.
* **data parallelism**: DDP all-reduces the fp32 gradients once per step (overlapped with the last micro-batch's
  backward: what is longer is exposed); ZeRO-1/2 reduce-scatter them (overlapped the same way) and all-gather the
  updated weights after the step (exposed); FSDP all-gathers the bf16 weights for every micro-batch's forward and
  backward (prefetched: exposed where longer than that micro-batch's compute) and reduce-scatters the gradients
  once per step. Under a pipeline, FSDP re-gathers for every micro-batch: the cost the notebook names.

The parallel groups are placed as Llama 3 placed them, ``[tp, cp, pp, dp]`` from the innermost (a group whose
ranks fit in one node uses NVLink). Not modelled: kernel efficiency, overlap of tensor-parallel traffic with
compute, stragglers and failures, the embedding's and head's imbalance between stages, the zero-bubble schedules
(their bubble is measured on notebook 13's ranks, not modelled at scale). Memory comes from the calculator, which
models GPipe and 1F1B; an interleaved layout's first stage is scaled by the stage-micro-batches torch's plan holds.

Example:
    >>> from utils.calculator import model_parallel as calc
    >>> shape = ModelShape.from_parallel_model(calc.ParallelModel.from_hf("llama-2-70b"))
    >>> step = step_time(shape, Layout(tp=8, pp=4, dp=2, zero=1), Workload(seq_len=4096, global_batch=64), H100_SXM)
    >>> round(step.bubble_share, 3), step.micro_batches
    (0.083, 32)
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field
from typing import Any, Sequence

from .checks import positive_int


@dataclass(frozen=True)
class Hardware:
    """The stated constants of a GPU cluster.

    Attributes:
        name: for tables.
        peak_flops: dense bf16 FLOP/s of one GPU.
        nvlink_bytes_per_s: one GPU's bandwidth to the others of its node, one direction.
        network_bytes_per_s: one GPU's bandwidth to other nodes, one direction (its NIC).
        gpus_per_node: GPUs joined by NVLink.
        memory_bytes: one GPU's memory.
        source: where the figures come from.
    """

    name: str
    peak_flops: float
    nvlink_bytes_per_s: float
    network_bytes_per_s: float
    gpus_per_node: int
    memory_bytes: float
    source: str


H100_SXM = Hardware(
    name="H100 SXM, 8 per node", peak_flops=989e12, nvlink_bytes_per_s=450e9, network_bytes_per_s=50e9,
    gpus_per_node=8, memory_bytes=80e9,
    source="NVIDIA H100 datasheet (SXM5: 989 TFLOP/s dense bf16, NVLink 900 GB/s both directions together, 80 GB); "
           "one 400 Gb/s NIC per GPU, as on Llama 3's clusters (Llama 3 paper, section 3.3.1)")


@dataclass(frozen=True)
class Workload:
    """What one optimizer step trains.

    Attributes:
        seq_len: tokens per sequence.
        global_batch: sequences per step, over all data-parallel ranks.
        micro_batch: sequences per micro-batch on one data-parallel rank.
        checkpointing: every block recomputes its forward in backward (one more forward of the blocks).
    """

    seq_len: int
    global_batch: int
    micro_batch: int = 1
    checkpointing: bool = True

    def __post_init__(self) -> None:
        for name in ("seq_len", "global_batch", "micro_batch"):
            positive_int(name, getattr(self, name))

    @property
    def tokens(self) -> int:
        return self.seq_len * self.global_batch


@dataclass(frozen=True)
class Layout:
    """The degrees, the data-parallel kind and the schedule.

    Attributes:
        tp, cp, pp, dp: degrees (``gpus = tp · cp · pp · dp``).
        zero: 0 DDP, 1 or 2 ZeRO, 3 FSDP.
        chunks: stages per pipeline rank (1: 1F1B; more: interleaved 1F1B).
        label: how a table names it (default: the degrees).
    """

    tp: int = 1
    cp: int = 1
    pp: int = 1
    dp: int = 1
    zero: int = 0
    chunks: int = 1
    label: str = ""

    def __post_init__(self) -> None:
        for name in ("tp", "cp", "pp", "dp", "chunks"):
            positive_int(name, getattr(self, name))
        if self.zero not in (0, 1, 2, 3):
            raise ValueError(f"zero must be 0 (DDP), 1 or 2 (ZeRO) or 3 (FSDP), got {self.zero!r}")
        if self.chunks > 1 and self.pp == 1:
            raise ValueError("an interleaved schedule needs a pipeline: expected pp > 1 with chunks > 1")

    @property
    def gpus(self) -> int:
        return self.tp * self.cp * self.pp * self.dp

    def name(self) -> str:
        """e.g. ``tp8 · pp16 (v4) · dp128 ZeRO-1``."""
        if self.label:
            return self.label
        parts = [f"{n}{d}" for n, d in (("tp", self.tp), ("cp", self.cp)) if d > 1]
        if self.pp > 1:
            parts.append(f"pp{self.pp}" + (f" (v{self.chunks})" if self.chunks > 1 else ""))
        if self.dp > 1:
            parts.append(f"dp{self.dp} {('DDP', 'ZeRO-1', 'ZeRO-2', 'FSDP')[self.zero]}")
        return " · ".join(parts) or "one GPU"


@dataclass
class StepTime:
    """A layout's modelled step, in seconds by term (``terms``), and what it yields.

    Attributes:
        layout, workload, hardware: the inputs.
        micro_batches: per data-parallel rank per step (``m``).
        terms: ``{"compute", "bubble", "tensor parallel", "context parallel", "pipeline sends",
            "data parallel"}`` seconds (the bubble is idle time, the traffic what is exposed).
        model_flops: FLOPs of the step without recomputation (what MFU counts).
    """

    layout: Layout
    workload: Workload
    hardware: Hardware
    micro_batches: int
    terms: dict[str, float] = field(default_factory=dict)
    model_flops: float = 0.0

    @property
    def seconds(self) -> float:
        return sum(self.terms.values())

    @property
    def mfu(self) -> float:
        """Model FLOPs utilisation: the step's model FLOPs over what the GPUs could do at peak in its time."""
        return self.model_flops / (self.layout.gpus * self.hardware.peak_flops * self.seconds)

    @property
    def bubble_share(self) -> float:
        return self.terms["bubble"] / self.seconds


@dataclass(frozen=True)
class ModelShape:
    """What the model's cost depends on: parameters that multiply, the input embedding, layers and widths."""

    name: str
    matmul_parameters: int
    layers: int
    width: int
    heads: int
    kv_heads: int

    @classmethod
    def from_parallel_model(cls, model: Any) -> "ModelShape":
        """From a calculator ``ParallelModel`` (``utils.calculator.model_parallel``): every parameter multiplies
        except the input embedding (``embed_tokens``, ``wte``, ``token_embedding``) and the norms' vectors."""
        embedding = ("embed_tokens", "wte", "token_embedding", "tok_embeddings", "wpe", "position")
        matmul = sum(math.prod(t.shape) for t in model.tensors
                     if len(t.shape) == 2 and not any(part in t.name for part in embedding))
        tied = not any(("lm_head" in t.name or t.name.endswith("head.weight")) for t in model.tensors)
        if tied and getattr(model, "vocab", 0):
            matmul += model.vocab * model.width            # a tied head multiplies by the embedding's matrix
        return cls(name=model.name, matmul_parameters=matmul, layers=model.layers, width=model.width,
                   heads=model.heads, kv_heads=model.kv_heads)


def _ring_all_reduce_s(nbytes: float, ranks: int, bandwidth: float) -> float:
    return 2 * (ranks - 1) / ranks * nbytes / bandwidth if ranks > 1 else 0.0


def _ring_gather_s(nbytes: float, ranks: int, bandwidth: float) -> float:
    """An all-gather (or reduce-scatter) whose whole result is ``nbytes``: each rank moves ``(N - 1) / N`` of it."""
    return (ranks - 1) / ranks * nbytes / bandwidth if ranks > 1 else 0.0


def step_time(model: ModelShape, layout: Layout, workload: Workload, hardware: Hardware) -> StepTime:
    """The modelled time of one optimizer step of ``model`` under ``layout`` (see the module's docstring).

    Args:
        model: a ``ModelShape`` (``ModelShape.from_parallel_model`` reads the calculator's models).
        layout: the degrees and schedule.
        workload: sequence length, global batch, micro-batch, checkpointing.
        hardware: the stated constants.

    Returns:
        A ``StepTime``.

    Raises:
        ValueError: a global batch the data-parallel ranks and micro-batches cannot split evenly, fewer
            micro-batches than stages, more stages than layers, heads that tp does not divide, a sequence that
            2·cp does not divide.

    Example:
        >>> shape = ModelShape("toy", matmul_parameters=8 * 10**9, layers=32, width=4096, heads=32, kv_heads=8)
        >>> step = step_time(shape, Layout(tp=8, pp=2, dp=4, zero=1), Workload(4096, 64), H100_SXM)
        >>> sorted(step.terms)
        ['bubble', 'compute', 'context parallel', 'data parallel', 'pipeline sends', 'tensor parallel']
    """
    tp, cp, pp, dp, v = layout.tp, layout.cp, layout.pp, layout.dp, layout.chunks
    per_rank, rest = divmod(workload.global_batch, dp * workload.micro_batch)
    if rest or per_rank == 0:
        raise ValueError(f"a global batch of {workload.global_batch} sequences over dp = {dp} ranks of "
                         f"{workload.micro_batch}-sequence micro-batches: expected a multiple of "
                         f"{dp * workload.micro_batch}")
    m = per_rank
    if pp > 1 and m < pp:
        raise ValueError(f"{m} micro-batches for {pp} pipeline stages: expected at least as many micro-batches as "
                         f"stages (a larger global batch, or fewer data-parallel ranks)")
    if pp * v > model.layers:
        raise ValueError(f"{pp} x {v} pipeline stages for {model.layers} layers: expected at most one stage per layer")
    if model.heads % tp:
        raise ValueError(f"{model.heads} heads over tp = {tp}: expected a divisor of the heads")
    if workload.seq_len % (2 * cp):
        raise ValueError(f"a sequence of {workload.seq_len} over cp = {cp}: expected a multiple of 2·cp")
    node = hardware.gpus_per_node

    def link(span: int) -> float:        # a group whose ranks sit within `span` consecutive GPUs
        return hardware.nvlink_bytes_per_s if span <= node else hardware.network_bytes_per_s

    seq, width, layers = workload.seq_len, model.width, model.layers
    tokens_mb = workload.micro_batch * seq
    # the pipeline runs at the pace of its busiest rank: ceil(layers / (pp·v)) layers per stage, v stages (the head's
    # matrix spread over the layers); its 1/tp of each matrix, its 1/cp of the tokens
    layers_per_rank = math.ceil(layers / (pp * v)) * v
    layer_flops = 2 * model.matmul_parameters / layers + 2 * seq * width      # one layer's forward, per token
    t_forward = tokens_mb * layers_per_rank * layer_flops / (tp * cp) / hardware.peak_flops
    t_compute = (4 if workload.checkpointing else 3) * t_forward             # + backward (2x), + recomputation
    activation = tokens_mb / cp * width * 2                                     # bf16, one (b, seq/cp, width)
    tp_collectives = 6 if workload.checkpointing else 4
    t_tp = layers_per_rank * tp_collectives * _ring_all_reduce_s(activation, tp, link(tp))
    head_dim = width // model.heads
    kv = 2 * tokens_mb * max(1, model.kv_heads // tp) * head_dim * 2            # K and V of the whole sequence, bf16
    cp_collectives = 3 if workload.checkpointing else 2
    t_cp = layers_per_rank * cp_collectives * _ring_gather_s(kv, cp, link(tp * cp))
    t_send = 2 * (activation / tp) / link(tp * cp * pp) if pp > 1 else 0.0      # sequence-parallel shards
    slot = t_compute + t_tp + t_cp + t_send                                     # one micro-batch on one stage
    # data parallelism: this rank's parameters (1/tp of the matrices of its layers)
    local_parameters = model.matmul_parameters / layers * layers_per_rank / tp
    dp_link = link(tp * cp * pp * dp)
    backward_window = 2 * t_forward                                             # the last micro-batch's backward
    if layout.zero == 0:
        t_dp = max(0.0, _ring_all_reduce_s(4 * local_parameters, dp, dp_link) - backward_window)
    elif layout.zero in (1, 2):
        t_dp = max(0.0, _ring_gather_s(4 * local_parameters, dp, dp_link) - backward_window) + \
            _ring_gather_s(4 * local_parameters, dp, dp_link)
    else:
        gather = _ring_gather_s(2 * local_parameters, dp, dp_link)               # bf16 weights, per micro-batch
        hidden = max(0.0, gather - t_forward) + max(0.0, gather - (t_compute - t_forward))   # behind fwd, bwd
        t_dp = m * hidden + max(0.0, _ring_gather_s(4 * local_parameters, dp, dp_link) - backward_window)
    terms = {"compute": m * t_compute, "bubble": (pp - 1) / v * slot,
             "tensor parallel": m * t_tp, "context parallel": m * t_cp, "pipeline sends": m * t_send,
             "data parallel": t_dp}
    model_flops = workload.tokens * 6 * (model.matmul_parameters + layers * seq * width)
    return StepTime(layout=layout, workload=workload, hardware=hardware, micro_batches=m, terms=terms,
                    model_flops=model_flops)


def candidate_layouts(gpus: int, *, tp_degrees: Sequence[int] = (1, 2, 4, 8), cp_degrees: Sequence[int] = (1, 2, 4),
                      pp_degrees: Sequence[int] = (1, 2, 4, 8, 16), zero_stages: Sequence[int] = (0, 1, 3),
                      chunks: Sequence[int] = (1,)) -> list[Layout]:
    """Every layout of exactly ``gpus`` GPUs from these degrees (data parallelism takes the rest).

    Example:
        >>> [layout.name() for layout in candidate_layouts(16, tp_degrees=(8,), cp_degrees=(1,), zero_stages=(1,))]
        ['tp8 · dp2 ZeRO-1', 'tp8 · pp2']
    """
    positive_int("gpus", gpus)
    layouts = []
    for tp in tp_degrees:
        for cp in cp_degrees:
            for pp in pp_degrees:
                model_parallel = tp * cp * pp
                if gpus % model_parallel:
                    continue
                dp = gpus // model_parallel
                for zero in (0,) if dp == 1 else zero_stages:      # one data-parallel rank: nothing to shard
                    for v in chunks:
                        if v > 1 and pp == 1:
                            continue
                        layouts.append(Layout(tp=tp, cp=cp, pp=pp, dp=dp, zero=zero, chunks=v))
    return layouts


@dataclass
class RankedLayout:
    """One row of ``rank_layouts``: the modelled step and the calculator's memory of its busiest GPU."""

    step: StepTime
    memory_bytes: float | None
    fits: bool
    refused: str = ""


def rank_layouts(model: Any, layouts: Sequence[Layout], workload: Workload, hardware: Hardware,
                 memory: Any = None, device_bytes: float | None = None) -> list[RankedLayout]:
    """Each layout's modelled step time and memory, the fitting ones fastest first, then those that do not fit.

    Args:
        model: a calculator ``ParallelModel`` (its shape feeds the time, the calculator its memory).
        layouts: candidates (``candidate_layouts``).
        workload, hardware: the step and the constants.
        memory: ``memory(model, layout, micro_batches) -> bytes of the busiest GPU`` (the notebook passes the
            calculator's ``predict_parallel``); None: no memory constraint.
        device_bytes: the budget per GPU (default: ``hardware.memory_bytes``).

    Returns:
        ``RankedLayout`` rows; a layout the model cannot be split into is left out.

    Example:
        >>> rows = rank_layouts(model, candidate_layouts(64), Workload(4096, 1024), H100_SXM,   # doctest: +SKIP
        ...                     calculator_memory(setup), 72e9)
        >>> rows[0].step.layout.name(), rows[0].fits                                           # doctest: +SKIP
        ('tp2 · cp2 · pp16', True)
    """
    shape = ModelShape.from_parallel_model(model)
    budget = hardware.memory_bytes if device_bytes is None else device_bytes
    rows = []
    for layout in layouts:
        try:
            step = step_time(shape, layout, workload, hardware)
            need = None if memory is None else memory(model, layout, step.micro_batches)
        except ValueError:
            continue
        rows.append(RankedLayout(step=step, memory_bytes=need, fits=need is None or need <= budget))
    return sorted(rows, key=lambda row: (not row.fits, row.step.seconds))


@functools.lru_cache(maxsize=256)
def interleaved_in_flight(pp: int, chunks: int, micro_batches: int) -> float:
    """Stage-micro-batches the first pipeline rank holds at its peak under torch's interleaved 1F1B (its ``chunks``
    stages each count ``1 / chunks``), read from torch's own plan (``pipeline_schedules.schedule_orders``).

    With ``micro_batches`` a multiple of ``pp`` torch runs rounds of ``pp`` micro-batches; from two rounds on the
    count does not depend on how many: the plan is built for two (tests check it against more).
    """
    from .pipeline_schedules import in_flight, schedule_orders
    if chunks == 1:
        return min(micro_batches, pp)
    planned = 2 * pp if micro_batches % pp == 0 and micro_batches >= 2 * pp else micro_batches
    return in_flight(schedule_orders("interleaved-1f1b", pp, planned, chunks)[0]) / chunks


def calculator_memory(setup: Any) -> Any:
    """A ``memory`` callback for ``rank_layouts``: the calculator's bytes of the layout's busiest GPU.

    The calculator (``utils.calculator.model_parallel``) models GPipe and 1F1B; for an interleaved layout the first
    stage's activations are scaled by the stage-micro-batches it holds (``interleaved_in_flight``) over 1F1B's.

    Args:
        setup: the calculator's ``TrainingSetup`` of one micro-batch (precision, checkpointing, ``seq_len``).
    """
    from .calculator import model_parallel as calc

    def memory(model: Any, layout: Layout, micro_batches: int) -> float:
        breakdown = calc.predict_parallel(model, setup, calc.ParallelLayout(
            tp=layout.tp, pp=layout.pp, cp=layout.cp, dp=layout.dp, zero=layout.zero, micro_batches=micro_batches))
        if layout.chunks == 1:
            return breakdown.total
        first = breakdown.stages[0]
        per_micro_batch = first.terms["activations"] / first.in_flight
        extra = (interleaved_in_flight(layout.pp, layout.chunks, micro_batches) - first.in_flight) * per_micro_batch
        return max(breakdown.total, first.total + extra)
    return memory


