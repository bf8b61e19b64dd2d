"""The layout of model parallelism (``ParallelLayout``: tp, pp, cp, dp and the ZeRO stage) and its arithmetic: each
pipeline stage's layers, the micro-batches a stage holds in flight, the bubble; and the per-stage result types
(``StageBytes``, ``ParallelBreakdown``) that ``model_parallel.predict_parallel`` returns (notebook 13)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ..checks import positive_int
from .config import TrainingSetup
from .parallel_tensors import ParallelModel

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
        ep: expert-parallel degree (a mixture of experts): each of ``ep`` data-parallel ranks holds ``E / ep`` of every
            layer's experts and receives the tokens routed to them (two all-to-alls each way); it borrows its ranks
            from ``dp`` (which it must divide, as torchtitan's and the notebook 14 ranks' layout), so the GPUs stay
            ``dp · tp · pp · cp``; the experts' state is replicated (or ZeRO-sharded) over the ``dp / ep`` copies.
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
    ep: int = 1

    def __post_init__(self) -> None:
        if self.ep != 1:                              # expert parallelism borrows data-parallel ranks
            positive_int("ep", self.ep)
            if self.dp % self.ep:
                raise ValueError(f"ep = {self.ep} expert-parallel ranks are taken from the dp = {self.dp} data-parallel "
                                 f"ranks: expected an ep that divides dp")
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
        parts += [f"ep{self.ep}"] if self.ep > 1 else []
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
