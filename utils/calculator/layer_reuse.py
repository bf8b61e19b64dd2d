"""One decoder layer replayed once, reused for every identical layer: the step's peak from its phases.

A replay is a list of phases (``replay.Phase``), each known by where it begins (bytes alive by kind), how far it
rises above that and what is alive at its top, and how it ends. ``compose`` walks such a list and finds the
step's peak exactly as the replay itself does (the first allocation that sets a new highest point), adding, where
asked, bytes alive over a range of phases: the previous step's outputs that a training loop's variable keeps
alive until the new ones replace them (``TrainingSetup.outputs="kept"``).

A deep stack of identical layers is the same few phases again and again, each block's forward adding what it
saves and each backward freeing it. ``replay`` replays a shorter model instead, built from the full one's first
``EDGE`` layers (and each kind's first layer), its last ``EDGE``, and, from its middle, two samples of each kind (``Family.layer_signature``: a
sliding or a full attention layer, ...), and builds the full list of phases from it: a middle layer of the full
model takes the phases of its kind's first sample (of layer: sliding or full attention, ...). What changes with depth outside the blocks comes from the full
model: the set-up before the step (parameters, optimizer state), the optimizer step's temporaries, and what a phase
that is not a block's frees of each block's tensors (autocast's weight copies, the cache that an output keeps:
each extra layer frees what its sample freed). The short replay checks itself: both samples of each kind must rise,
fall and free alike, and no phase outside the blocks may free a sample's tensor before it allocates; otherwise,
and for shallow models, the whole model is replayed. ``tests/test_calculator_reuse.py`` compares both on many set-ups.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any, Callable, Hashable, Sequence

from . import registry
from .config import KINDS, ModelConfig, TrainingSetup
from .replay import Phase

EDGE = 2                                   # layers at each end replayed as themselves (their neighbours differ)


@dataclass
class StepResult:
    """What a replayed step amounts to (what ``predict`` and the validation read).

    Attributes:
        peak: the highest point, bytes; peak_kinds: what was alive then, by kind; peak_phase: its phase's name.
        largest: each kind at its own highest point.
        phase_marks: phase -> bytes alive when it ended.
        baseline: bytes alive when the step began (model, optimizer state, batch; the previous outputs if kept).
        grads_mark: bytes alive when ``optimizer.step()`` began; grads_at_step: the gradients then.
        reused: whether a shorter replay stood for the model's identical layers.
    """

    peak: int
    peak_kinds: dict[str, int]
    peak_phase: str
    largest: dict[str, int]
    phase_marks: dict[str, int] = field(default_factory=dict)
    baseline: int = 0
    grads_mark: int = 0
    grads_at_step: int = 0
    reused: bool = False


def _add(a: dict[str, int], b: dict[str, int], times: int = 1) -> dict[str, int]:
    return {kind: a.get(kind, 0) + times * b.get(kind, 0) for kind in KINDS}


def compose(phases: Sequence[Phase], offsets: Sequence[tuple[dict[str, int], int, int]] = ()) -> StepResult:
    """The step's peak from its phases (each ``start`` absolute), with ``offsets``: (bytes by kind, first phase
    index, stop phase index) alive over those phases besides what the phases say."""
    peak, peak_kinds, peak_phase = -1, dict.fromkeys(KINDS, 0), ""
    largest = dict.fromkeys(KINDS, 0)
    marks: dict[str, int] = {}
    result = StepResult(0, {}, "", largest)
    for index, phase in enumerate(phases):
        extra = dict.fromkeys(KINDS, 0)
        for nbytes, first, stop in offsets:
            if first <= index < stop:
                extra = _add(extra, nbytes)
        start = _add(phase.start, extra)
        if phase.top is not None:
            total = sum(start.values()) + phase.top
            if total > peak:
                peak, peak_kinds, peak_phase = total, _add(start, phase.top_kinds), phase.name
        for kind in KINDS:
            largest[kind] = max(largest[kind], start[kind] + phase.kind_top.get(kind, 0))
        end = _add(phase.end, extra)
        marks[phase.name] = sum(end.values())
        if phase.name == "init":
            result.baseline = marks["init"]
        if phase.name == "optimizer":
            result.grads_mark, result.grads_at_step = sum(start.values()), start["gradients"]
    result.peak, result.peak_kinds, result.peak_phase, result.phase_marks = peak, peak_kinds, peak_phase, marks
    return result


def _prior_outputs(step: Any, phases: Sequence[Phase], held: dict[str, tuple[int, dict, dict]],
                   extra_layers: Callable[[dict[int, dict[str, int]]], dict[str, int]] | None = None
                   ) -> list[tuple[dict[str, int], int, int]]:
    """Under ``outputs="kept"``: what the loop's variables held when the previous step ended, alive from the start
    of this one until the phase that first rebinds each (the previous step ended as this one does)."""
    if step.family.outputs(step.setup) != "kept":
        return []
    names = [phase.name for phase in phases]
    offsets = []
    for key, (first, by_kind, by_tag) in held.items():
        nbytes = _add(dict.fromkeys(KINDS, 0), by_kind)
        if extra_layers is not None:
            nbytes = _add(nbytes, extra_layers(by_tag))
        offsets.append((nbytes, 0, names.index(step.phases[first].name)))
    return offsets


def _signature_plan(signatures: list[Hashable]) -> tuple[list[int], dict[int, int]] | None:
    """Which full-model middle layers a shorter replay keeps, and for each kept one the representative it must
    equal; None when nothing is saved. Indices are the full model's."""
    total = len(signatures)
    # each kind's first layer is kept whole too: under checkpointing its backward frees what the kind's layers share
    first = max(EDGE, 1 + max(signatures.index(sig) for sig in set(signatures)))
    middle = list(range(first, total - EDGE))
    sigs = [signatures[i] for i in middle]
    chosen: list[int] | None = None
    for period in range(1, len(sigs) // 3 + 1):        # a periodic middle: its first and last periods
        if all(sigs[i] == sigs[i + period] for i in range(len(sigs) - period)):
            chosen = middle[:period] + middle[-period:]
            break
    if chosen is None:                                  # runs of equal layers: the first two of each run
        chosen = [index for position, index in enumerate(middle)
                  if position < 2 or sigs[position - 1] != sigs[position] or sigs[position - 2] != sigs[position]]
    if len(chosen) + first + EDGE >= total - 2:
        return None
    representative: dict[int, int] = {}
    first_of: dict[Hashable, int] = {}
    for index in chosen:
        representative[index] = first_of.setdefault(signatures[index], index)
    counts = {sig: sum(signatures[i] == sig for i in chosen) for sig in first_of}
    if min(counts.values()) < 2:
        return None
    return chosen, representative


def _same(a: Phase, b: Phase) -> bool:
    return (a.delta() == b.delta() and a.top == b.top and a.top_kinds == b.top_kinds and a.kind_top == b.kind_top)


def replay(model: ModelConfig, setup: TrainingSetup, step_class: type, trace: bool = False) -> StepResult:
    """The step of ``model`` under ``setup``: a shorter replay standing for the identical middle layers where that
    is exact (see the module's docstring), else the whole model's."""
    family = registry.family_of(model.arch)
    signatures = [family.layer_signature(model, i) for i in range(model.num_layers)]
    plan = None if trace or model.num_layers <= 2 * EDGE + 4 else _signature_plan(signatures)
    if plan is not None:
        result = _reused(model, setup, step_class, signatures, *plan)
        if result is not None:
            return result
    step = step_class(model, setup, trace).run()
    return compose(step.phases, _prior_outputs(step, step.phases, step.held_bytes()))


def _reused(model: ModelConfig, setup: TrainingSetup, step_class: type, signatures: list[Hashable],
            chosen: list[int], representative: dict[int, int]) -> StepResult | None:
    total = model.num_layers
    first = min(chosen)                                  # the whole layers before the middle
    kept = list(range(first)) + chosen + list(range(total - EDGE, total))
    short = replace(model, num_layers=len(kept),
                    layer_types=None if model.layer_types is None else tuple(model.layer_types[i] for i in kept))
    step = step_class(short, setup).run()
    position = {full: short_index for short_index, full in enumerate(kept)}      # full index -> short index
    rep_short = {position[full]: position[representative[full]] for full in chosen}
    samples = set(rep_short)
    reps = set(rep_short.values())
    by_name = {phase.name: phase for phase in step.phases}
    # the samples of each kind must replay alike, and nothing outside the blocks may free one and then allocate
    for phase in step.phases:
        micro, _, where = phase.name.partition(".")
        if where[:1] in ("f", "b") and where[1:].isdigit() and int(where[1:]) in samples:
            twin = by_name[f"{micro}.{where[0]}{rep_short[int(where[1:])]}"]
            if not _same(phase, twin):
                return None
        elif phase.freed_then_allocated & samples:
            return None
        elif phase.tagged_allocs and (phase.untagged_allocs or any(
                v < 0 for frees in phase.tag_frees.values() for v in frees.values())):
            return None                                  # made a block's tensors among others: not composable
        for tag in samples - reps:
            if phase.tag_frees.get(tag, {}) != phase.tag_frees.get(rep_short[tag], {}):
                return None
    middle = list(range(first, total - EDGE))
    extra = {}                                          # representative (short index) -> layers it stands for beyond
    for rep in reps:
        in_full = sum(1 for i in middle if position[representative_of(signatures, i, representative)] == rep)
        in_short = sum(1 for s in samples if rep_short[s] == rep)
        extra[rep] = in_full - in_short

    def extra_bytes(by_tag: dict[int, dict[str, int]]) -> dict[str, int]:
        out = dict.fromkeys(KINDS, 0)
        for rep, more in extra.items():
            out = _add(out, by_tag.get(rep, {}), more)
        return out

    full = step_class(model, setup)                      # the whole model's set-up and optimizer step
    full.prologue()
    full.set_phase("optimizer")
    full.optimizer_temporaries()
    full.finish()
    init, optimizer = full.phases[0], full.phases[-1]
    phases: list[Phase] = []
    state = dict(init.end)
    phases.append(init)
    first_middle, last_middle = first, len(kept) - EDGE - 1
    for phase in step.phases[1:]:
        micro, _, where = phase.name.partition(".")
        if where[:1] in ("f", "b") and where[1:].isdigit():
            index = int(where[1:])
            if first_middle <= index <= last_middle:
                if index != (first_middle if where[0] == "f" else last_middle):
                    continue                             # the middle is emitted whole at its first phase
                order = middle if where[0] == "f" else middle[::-1]
                for full_index in order:
                    source = by_name[f"{micro}.{where[0]}{position[representative_of(signatures, full_index, representative)]}"]
                    state = _emit(phases, source, f"{micro}.{where[0]}{full_index}", state, source.delta())
                continue
            name = f"{micro}.{where[0]}{kept[index]}"
            state = _emit(phases, phase, name, state, phase.delta())
            continue
        more = extra_bytes(phase.tag_frees)
        delta = _add(phase.delta(), more)
        source = phase
        if phase.name == "optimizer":
            source = optimizer
        state = _emit(phases, source, phase.name, state, delta)
        if phase.tagged_allocs and phase.top is not None:  # only a block's tensors made: they all count at its top
            last = phases[-1]
            last.top = phase.top + sum(more.values())
            last.top_kinds = _add(phase.top_kinds, more)
            last.kind_top = {kind: phase.kind_top.get(kind, 0) + max(0, more[kind]) for kind in KINDS}
    result = compose(phases, _prior_outputs(step, phases, step.held_bytes(), extra_bytes))
    result.reused = True
    return result


def representative_of(signatures: list[Hashable], full_index: int, representative: dict[int, int]) -> int:
    """The chosen layer (full index) whose phases stand for middle layer ``full_index``."""
    for chosen, rep in representative.items():
        if signatures[chosen] == signatures[full_index]:
            return rep
    raise AssertionError("a middle layer without a sample")  # pragma: no cover - _signature_plan covers every kind


def _emit(phases: list[Phase], source: Phase, name: str, state: dict[str, int], delta: dict[str, int]
          ) -> dict[str, int]:
    phase = Phase(name, dict(state))
    phase.top, phase.top_kinds, phase.kind_top = source.top, source.top_kinds, source.kind_top
    phase.end = _add(state, delta)
    phases.append(phase)
    return phase.end
