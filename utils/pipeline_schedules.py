"""Pipeline schedules as orders of actions: the bubble each one leaves and the micro-batches each rank holds.

Introduced in notebook 13 (model parallelism, section 3), whose gloo ranks run every schedule
``torch.distributed.pipelining`` ships and log, on each rank, the order in which the schedule called its stages'
forwards and backwards. This module reads such orders, the logged ones or the ones torch plans for any pipeline:

* **Actions.** An action is ``(kind, stage, micro_batch)``: ``"F"`` a forward; ``"B"`` a whole backward; ``"I"``
  the backward for the stage's *input* only and ``"W"`` the one for its *weights*, which the zero-bubble schedules
  split apart so that ``W`` can fill the idle slots.
* **torch's plan** (``schedule_orders``): the order of every rank for any number of ranks, stages per rank and
  micro-batches, read from torch's own schedule classes (``pipeline_order``), built on a ``fake`` process group in
  this process: no rank is started. ``available_schedules`` says which classes this torch has.
* **The bubble** (``simulate_schedule``): each rank runs its order one action after the other, each action as
  soon as what it needs is done (a forward waits for the previous stage's forward of that micro-batch, an input
  backward for the next stage's, a weight backward for its own input backward), with stated durations in units
  of one forward of one stage. The bubble is the idle share of ``ranks x`` the step's time:
  ``(p - 1) / (m + p - 1)`` for GPipe and 1F1B, whatever the ratio of backward to forward.
* **Memory** (``in_flight``, ``replay_held_bytes``): the micro-batches a rank holds (forwards whose backward has not
  finished), and the bytes autograd keeps for them given each stage's bytes after one forward and after one input
  backward; the notebook's ranks measured those bytes, and the replay equals their peaks to the byte.
* **What the ranks measured** (``stage_bytes``): each stage's bytes per micro-batch and each rank's peak for a
  schedule, read from notebook 13's rank records: the figures a calculator of pipeline memory validates against.

Known limitations: the simulation has no communication time and equal stages; DualPipeV's overlapped
forward-backward pairs run one after the other (they overlap on a GPU, not on a CPU rank).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence

from .checks import positive_int

Action = tuple[str, int, int]          # (kind, stage, micro-batch)
KINDS = ("F", "B", "I", "W")

# name -> (torch's class, how stages sit on the ranks): "loop" puts stage s on rank s % p (rank r holds r, r + p,
# r + 2p, ...); "v" puts rank r's two stages at r and 2p - 1 - r, so the last stage is back on rank 0
SCHEDULE_CLASSES = {"gpipe": ("ScheduleGPipe", "single"), "1f1b": ("Schedule1F1B", "single"),
                    "interleaved-1f1b": ("ScheduleInterleaved1F1B", "loop"),
                    "interleaved-zero-bubble": ("ScheduleInterleavedZeroBubble", "loop"),
                    "zbv": ("ScheduleZBVZeroBubble", "v"), "dualpipev": ("ScheduleDualPipeV", "v")}
MULTI_STAGE = tuple(name for name, (_, style) in SCHEDULE_CLASSES.items() if style != "single")
# a backward costs two forwards (input gradient + weight gradient), as the Zero Bubble paper (Qi et al. 2024) and
# Narayanan et al. (2021) count it
DURATIONS = {"F": 1.0, "B": 2.0, "I": 1.0, "W": 1.0}


def available_schedules() -> dict[str, Any]:
    """Each schedule's torch class, or None where this torch does not ship it (e.g. DualPipeV before torch 2.9).

    Example:
        >>> available_schedules()["1f1b"].__name__
        'Schedule1F1B'
    """
    from torch.distributed.pipelining import schedules
    return {name: getattr(schedules, cls, None) for name, (cls, _) in SCHEDULE_CLASSES.items()}


def stages_per_rank(schedule: str) -> int | None:
    """1 for GPipe and 1F1B, 2 for the V schedules (exactly two), None for the looped ones (any number).

    Example:
        >>> stages_per_rank("zbv"), stages_per_rank("interleaved-1f1b")
        (2, None)
    """
    style = _style(schedule)
    return 1 if style == "single" else 2 if style == "v" else None


def stage_indices(schedule: str, rank: int, ranks: int, chunks: int = 1) -> list[int]:
    """The pipeline stages rank ``rank`` holds under ``schedule``, with ``chunks`` stages per rank.

    Args:
        schedule: a key of ``SCHEDULE_CLASSES``.
        rank: 0 .. ranks - 1.
        ranks: ranks in the pipeline (``p``).
        chunks: stages per rank (``v``; 1 for GPipe and 1F1B, 2 for the V schedules).

    Returns:
        Stage indices in increasing order: ``[rank]``; looped ``[rank, rank + p, ...]``; V ``[rank, 2p - 1 - rank]``.

    Example:
        >>> stage_indices("zbv", 1, 4, 2)
        [1, 6]
    """
    positive_int("ranks", ranks)
    positive_int("chunks", chunks)
    if not 0 <= rank < ranks:
        raise ValueError(f"rank must be in 0..{ranks - 1}, got {rank!r}")
    style = _style(schedule)
    if style == "single":
        if chunks != 1:
            raise ValueError(f"{schedule} runs one stage per rank: expected chunks = 1, got {chunks}")
        return [rank]
    if style == "v":
        if chunks != 2:
            raise ValueError(f"{schedule} runs exactly two stages per rank (a V): expected chunks = 2, got {chunks}")
        return [rank, 2 * ranks - 1 - rank]
    return [rank + i * ranks for i in range(chunks)]


def _style(schedule: str) -> str:
    if schedule not in SCHEDULE_CLASSES:
        raise ValueError(f"unknown schedule {schedule!r}: expected one of {tuple(SCHEDULE_CLASSES)}")
    return SCHEDULE_CLASSES[schedule][1]


def schedule_orders(schedule: str, ranks: int, micro_batches: int, chunks: int = 1) -> dict[int, list[Action]]:
    """torch's own plan for every rank: the compute actions each rank runs, in order.

    Built from ``torch.distributed.pipelining``'s schedule class on a ``fake`` process group of ``ranks`` ranks in
    this process (rank 0's stages are tiny ``nn.Linear`` stand-ins; a schedule plans every rank's actions when it
    is built). GPipe and 1F1B keep no plan in torch: their orders are written here as their classes run them
    (all forwards then all backwards; ``p - rank - 1`` warm-up forwards, then one forward one backward, then the
    cool-down backwards) and the notebook checks them against the order its ranks logged.

    Args:
        schedule: a key of ``SCHEDULE_CLASSES``.
        ranks: ranks in the pipeline.
        micro_batches: micro-batches per step.
        chunks: stages per rank.

    Returns:
        ``{rank: [(kind, stage, micro_batch), ...]}``; an overlapped forward-backward pair (DualPipeV) is two actions.

    Raises:
        ValueError: an unknown schedule, this torch lacking it, or a pipeline torch refuses (its message).
        RuntimeError: a process group is already initialised in this process.

    Example:
        >>> schedule_orders("interleaved-1f1b", 2, 2, 2)[0][:3]
        [('F', 0, 0), ('F', 0, 1), ('F', 2, 0)]
    """
    positive_int("micro_batches", micro_batches)
    key = (schedule, ranks, micro_batches, chunks)
    if key not in _PLANS:                     # a plan is fixed by its four numbers: built once, copied out
        _PLANS[key] = _plan(schedule, ranks, micro_batches, chunks)
    return {rank: list(order) for rank, order in _PLANS[key].items()}


_PLANS: dict[tuple, dict[int, list[Action]]] = {}


def _plan(schedule: str, ranks: int, micro_batches: int, chunks: int) -> dict[int, list[Action]]:
    indices = {rank: stage_indices(schedule, rank, ranks, chunks) for rank in range(ranks)}
    if _style(schedule) == "single":
        return {rank: _single_stage_order(schedule, rank, ranks, micro_batches) for rank in range(ranks)}
    cls = available_schedules()[schedule]
    if cls is None:
        import torch
        raise ValueError(f"torch {torch.__version__} has no {SCHEDULE_CLASSES[schedule][0]}: expected one of "
                         f"{[name for name, c in available_schedules().items() if c is not None]}")
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch import nn
    from torch.distributed.pipelining import PipelineStage
    from torch.testing._internal.distributed.fake_pg import FakeStore
    if dist.is_initialized():
        raise RuntimeError("schedule_orders builds torch's schedule on a fake process group of its own: expected no "
                           "process group initialised in this process")
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=ranks)
    try:
        stages = [PipelineStage(nn.Linear(1, 1), index, ranks * chunks, torch.device("cpu")) for index in indices[0]]
        plan = cls(stages, n_microbatches=micro_batches, loss_fn=F.mse_loss).pipeline_order
    finally:
        dist.destroy_process_group()
    orders = {}
    for rank in range(ranks):
        orders[rank] = [(sub.computation_type.value, sub.stage_index, sub.microbatch_index)   # an overlapped pair
                        for action in plan[rank] if action is not None                  # (DualPipeV) is two
                        for sub in (getattr(action, "sub_actions", None) or (action,))]
    return orders


def _single_stage_order(schedule: str, rank: int, ranks: int, micro_batches: int) -> list[Action]:
    if schedule == "gpipe":
        return [("F", rank, i) for i in range(micro_batches)] + [("B", rank, i) for i in range(micro_batches)]
    warmup = min(micro_batches, ranks - rank - 1)
    order = [("F", rank, i) for i in range(warmup)]
    for i in range(micro_batches - warmup):                 # steady state: one forward, one backward
        order += [("F", rank, warmup + i), ("B", rank, i)]
    return order + [("B", rank, i) for i in range(micro_batches - warmup, micro_batches)]


@dataclass
class ScheduleSimulation:
    """What ``simulate_schedule`` returns.

    Attributes:
        intervals: per rank, ``(start, end, action)`` of each action it ran, in its order.
        makespan: the step's time (units of one stage's forward of one micro-batch).
        busy: per rank, the time it computed.
        bubble: idle share of ``ranks x makespan``.
    """

    intervals: dict[int, list[tuple[float, float, Action]]]
    makespan: float
    busy: dict[int, float] = field(default_factory=dict)

    @property
    def bubble(self) -> float:
        return 1 - sum(self.busy.values()) / (len(self.busy) * self.makespan)


def _needs(action: Action, num_stages: int, backward_kind: Mapping[tuple[int, int], str]) -> list[Action]:
    kind, stage, micro = action
    if kind == "F":
        return [("F", stage - 1, micro)] if stage > 0 else []
    if kind in ("B", "I"):
        needs = [("F", stage, micro)]
        if stage < num_stages - 1:                       # the gradient of our output comes from the next stage
            needs.append((backward_kind[(stage + 1, micro)], stage + 1, micro))
        return needs
    return [("I", stage, micro)]                          # W: after this stage's input backward


def simulate_schedule(orders: Mapping[int, Sequence[Action]],
                      durations: Mapping[str, float] | None = None) -> ScheduleSimulation:
    """Run each rank's order with stated durations; each action starts when its rank is free and its inputs exist.

    Args:
        orders: ``{rank: [(kind, stage, micro_batch), ...]}`` (``schedule_orders``, or what ranks logged).
        durations: time of each kind, in units of one forward of one stage (default ``DURATIONS``: F 1, B 2,
            I 1, W 1). With several stages per rank, a stage is ``1/chunks`` of a rank's layers: divide by it to
            compare with one stage per rank (the bubble, a share, does not change).

    Returns:
        A ``ScheduleSimulation``.

    Raises:
        ValueError: an unknown kind, an action twice, or a backward of a stage whose next stage never runs one.
        RuntimeError: the orders deadlock (a rank waits for an action that cannot happen before it).

    Example:
        >>> simulate_schedule(schedule_orders("1f1b", 4, 8)).bubble     # (4 - 1) / (8 + 4 - 1)
        0.2727272727272727
    """
    durations = dict(DURATIONS if durations is None else durations)
    actions = [a for order in orders.values() for a in order]
    unknown = {a[0] for a in actions} - set(KINDS)
    if unknown:
        raise ValueError(f"unknown action kinds {sorted(unknown)}: expected some of {KINDS}")
    if len(set(actions)) != len(actions):
        raise ValueError("an action appears twice: expected each (kind, stage, micro-batch) once")
    num_stages = max(a[1] for a in actions) + 1
    backward_kind = {(a[1], a[2]): a[0] for a in actions if a[0] in ("B", "I")}
    finish: dict[Action, float] = {}
    position = {rank: 0 for rank in orders}
    free = {rank: 0.0 for rank in orders}
    busy = {rank: 0.0 for rank in orders}
    intervals: dict[int, list[tuple[float, float, Action]]] = {rank: [] for rank in orders}
    remaining = len(actions)
    while remaining:
        progressed = False
        for rank, order in orders.items():
            while position[rank] < len(order):
                action = tuple(order[position[rank]])
                try:
                    needs = _needs(action, num_stages, backward_kind)
                except KeyError:
                    raise ValueError(f"{action} needs the backward of stage {action[1] + 1} for micro-batch "
                                     f"{action[2]}, which no rank runs") from None
                if not all(need in finish for need in needs):
                    break
                start = max([free[rank]] + [finish[need] for need in needs])
                end = start + durations[action[0]]
                finish[action], free[rank] = end, end
                busy[rank] += durations[action[0]]
                intervals[rank].append((start, end, action))
                position[rank] += 1
                remaining -= 1
                progressed = True
        if not progressed:
            waiting = {rank: tuple(order[position[rank]]) for rank, order in orders.items()
                       if position[rank] < len(order)}
            raise RuntimeError(f"the orders deadlock: each rank waits for an action no rank can run first {waiting}")
    return ScheduleSimulation(intervals=intervals, makespan=max(free.values()), busy=busy)


def in_flight(order: Sequence[Action]) -> int:
    """The most stage-micro-batches a rank held at once: forwards whose backward (B, or W after I) has not run.

    Example:
        >>> in_flight(schedule_orders("1f1b", 4, 8)[0])     # the first stage of four
        4
    """
    held, peak = 0, 0
    for kind, _, _ in order:
        held += {"F": 1, "B": -1, "I": 0, "W": -1}[kind]
        peak = max(peak, held)
    return peak


def replay_held_bytes(order: Sequence[Action], after_forward: Mapping[int, int],
                      after_input_backward: Mapping[int, int] | None = None) -> list[int]:
    """The bytes autograd keeps on a rank after each action of its order, from each stage's bytes per micro-batch.

    A forward of stage ``s`` adds ``after_forward[s]``; a whole backward frees it; an input backward frees all but
    ``after_input_backward[s]`` (what the weight backward still needs), and the weight backward frees that.

    Args:
        order: one rank's actions.
        after_forward: per stage, bytes one micro-batch keeps after its forward.
        after_input_backward: per stage, bytes one micro-batch still keeps after its input backward (needed only
            for orders with I and W).

    Returns:
        The bytes held after each action (its maximum is the rank's peak).

    Example:
        >>> replay_held_bytes([("F", 0, 0), ("F", 0, 1), ("I", 0, 0), ("W", 0, 0), ("B", 0, 1)], {0: 100}, {0: 30})
        [100, 200, 130, 100, 0]
    """
    held, trace = 0, []
    for kind, stage, _ in order:
        if kind == "F":
            held += after_forward[stage]
        elif kind == "B":
            held -= after_forward[stage]
        elif kind == "I":
            held -= after_forward[stage] - _weight_pass(after_input_backward, stage)
        elif kind == "W":
            held -= _weight_pass(after_input_backward, stage)
        else:
            raise ValueError(f"unknown action kind {kind!r}: expected one of {KINDS}")
        trace.append(held)
    return trace


def _weight_pass(after_input_backward: Mapping[int, int] | None, stage: int) -> int:
    if after_input_backward is None:
        raise ValueError("an order with input (I) and weight (W) backwards needs after_input_backward: the bytes a "
                         "micro-batch keeps between the two, per stage")
    return after_input_backward[stage]


def stage_bytes(ranks: Sequence[Mapping[str, Any]], schedule: str) -> dict[str, Any]:
    """What notebook 13's ranks measured for ``schedule``: each stage's bytes per micro-batch, each rank's peak.

    Args:
        ranks: the rank records of ``utils.model_parallel.launch`` (``run.ranks``), with the ``"pp"`` part.
        schedule: a schedule the ranks ran (a key of each record's ``"pp"``).

    Returns:
        ``{"after_forward": {stage: bytes}, "after_input_backward": {stage: bytes}, "peak": [bytes per rank],
        "order": {rank: [(kind, stage, micro_batch), ...]}, "micro_batches": m, "chunks": stages per rank}``:
        the figures a model of pipeline memory (the calculator's) must reproduce to the byte.

    Raises:
        KeyError: the ranks did not run ``schedule`` (with the ones they ran).

    Example:
        >>> run = utils.model_parallel.launch(utils.model_parallel.ModelParallelConfig(), "build/13")  # doctest: +SKIP
        >>> stage_bytes(run.ranks, "zbv")["peak"]                                                      # doctest: +SKIP
        [507904, 532480, 532480, 532480]
    """
    records = [r["pp"] for r in sorted(ranks, key=lambda r: r["rank"])]
    if schedule not in records[0]:
        ran = sorted(k for k in records[0] if k in SCHEDULE_CLASSES)
        raise KeyError(f"the ranks did not run {schedule!r}: they ran {ran}")
    after_forward, after_input = {}, {}
    for record in records:
        part = record[schedule]
        after_forward.update({int(s): b for s, b in part["after_forward"].items()})
        after_input.update({int(s): b for s, b in part["after_input_backward"].items()})
    return {"after_forward": after_forward, "after_input_backward": after_input,
            "peak": [record[schedule]["peak_saved_bytes"] for record in records],
            "order": {rank: [tuple(a) for a in record[schedule]["order"]] for rank, record in enumerate(records)},
            "micro_batches": records[0][schedule]["micro_batches"], "chunks": records[0][schedule]["chunks"]}


def one_f_one_b_bubble(stages: int, micro_batches: int) -> float:
    """GPipe's and 1F1B's idle share of the step: ``(p - 1) / (m + p - 1)`` (Narayanan et al. quote ``(p - 1) / m``,
    the idle time over the ideal time instead of over the step's).

    Example:
        >>> one_f_one_b_bubble(4, 8)
        0.2727272727272727
    """
    positive_int("stages", stages)
    positive_int("micro_batches", micro_batches)
    return (stages - 1) / (micro_batches + stages - 1)


def ratio_to_ideal(bubble: float) -> float:
    """A bubble as a share of the step turned into idle time over ideal time: ``b / (1 - b)``
    (``(p - 1) / (m + p - 1)`` becomes ``(p - 1) / m``).

    Example:
        >>> round(ratio_to_ideal(one_f_one_b_bubble(4, 8)), 12)     # (4 - 1) / 8
        0.375
    """
    if not 0 <= bubble < 1:
        raise ValueError(f"a bubble is a share of the step in [0, 1), got {bubble!r}")
    return bubble / (1 - bubble)


__all__ = ["Action", "DURATIONS", "MULTI_STAGE", "SCHEDULE_CLASSES", "ScheduleSimulation", "available_schedules",
           "in_flight", "one_f_one_b_bubble", "ratio_to_ideal", "replay_held_bytes", "schedule_orders",
           "simulate_schedule", "stage_bytes", "stage_indices", "stages_per_rank"]

