"""The largest batch that fits: a search under a memory budget, a prediction, and a comparison of configurations.

Introduced in notebook 17 (the capstone). These are instruments: the training step they measure is the
reader's own (notebook 17 writes it in plain PyTorch: autocast, checkpointed blocks, accumulation, fused
AdamW), passed in as ``step(batch_size)``.

``find_max_batch_size`` doubles the batch size until a training step runs out of memory, then bisects
between the last size that ran and the first that did not (the search of Lightning's
``BatchSizeFinder`` in ``binsearch`` mode; accelerate's ``find_executable_batch_size`` only halves).
The budget is real on both devices: on the CPU the exact tracker of ``utils.memory`` raises
``torch.OutOfMemoryError`` when the tracked bytes would pass it, so the same search runs on a laptop;
on CUDA it is ``torch.cuda.set_per_process_memory_fraction``.

The two budgets count different things. The tracker counts the bytes of live tensor storages: the
``model``/``optimizer`` followed from before each try, plus what the step allocates. The CUDA limit
counts the caching allocator's *reserved* bytes (what it obtained with ``cudaMalloc``, its cache and
rounding included), and the allocator checks it only when it asks the driver for more: blocks already
in its cache are reused unchecked. So before each try under a CUDA budget the search empties the cache
(``torch.cuda.empty_cache()``), or an earlier, larger run's cache would let the step pass the budget.

Recovering from out-of-memory properly matters as much as the search: the exception's traceback holds
the frames of the failed step, and those frames hold its activations. The search keeps no reference to
the exception (it only notes that one happened, inside the ``except`` block, whose name Python deletes
on leaving it), drops the failed step's gradients, then calls ``gc.collect()`` and, on CUDA,
``torch.cuda.empty_cache()`` before the next try.

``largest_batches`` predicts, then searches, the largest batch of several configurations of a
reader's own step (each built fresh by a function the reader writes).
"""

from __future__ import annotations

import gc
import math
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Mapping

import torch
from torch import nn

from .checks import positive_int
from .footprint import predict_model_state
from .memory import measure_memory

# what a configuration's factory returns: a fresh step(batch_size), and the model and optimizer it trains
StepFactory = Callable[[], "tuple[Callable[[int], Any], nn.Module, torch.optim.Optimizer]"]


class CapacityError(RuntimeError):
    """The memory budget is too small for the smallest batch the search (or the prediction's probe) tries."""


@dataclass(frozen=True)
class BatchSearch:
    """What ``find_max_batch_size`` found.

    Attributes:
        largest: the largest batch size that ran (every size reported here was tried and ran).
        first_failure: the smallest size that ran out of memory, or None when ``limit`` ran.
        trials: ``(batch_size, ran)`` in the order tried.
        peak_bytes: ``batch_size -> peak bytes`` of the sizes that ran (tracker: followed bytes
            including the ``include`` baseline; CUDA: ``max_memory_allocated``).
        budget_bytes: the budget the search ran under.
    """

    largest: int
    first_failure: int | None
    trials: tuple[tuple[int, bool], ...]
    peak_bytes: Mapping[int, int]
    budget_bytes: int

    @property
    def resolution(self) -> int:
        """How far the true limit can be above ``largest``: 1 after a full bisection, 0 if ``limit`` ran."""
        return 0 if self.first_failure is None else self.first_failure - self.largest


def _release(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def check_budget(device: torch.device | str, budget_bytes: int) -> int:
    """Return ``budget_bytes`` if it is a positive int that the device can hold; a ValueError otherwise.

    On CUDA a budget above the card's total memory cannot be enforced (a per-process fraction is at
    most 1.0): it is refused here rather than silently clamped, so that "under N MiB" stays true.

    Raises:
        ValueError: not a positive int, or more than a CUDA device's total memory.
    """
    budget_bytes = positive_int("budget_bytes", budget_bytes, "bytes")
    device = torch.device(device)
    if device.type == "cuda":
        total = torch.cuda.get_device_properties(device).total_memory
        if budget_bytes > total:
            raise ValueError(f"budget_bytes={budget_bytes:,} ({budget_bytes / 2**20:,.0f} MiB) exceeds {device}'s "
                             f"{total / 2**20:,.0f} MiB: expected a budget the card can hold (size it with "
                             "utils.by_memory)")
    return budget_bytes


_frozen_depth = 0


@contextmanager
def _gc_frozen() -> Iterator[None]:
    """Freeze the objects that exist now, so each ``gc.collect()`` inside scans only what was made since.

    The objects alive when a search starts (the model, torch, the library; hundreds of thousands once
    ``torch._dynamo`` is imported) are not garbage, and a full collection scans them all: about half a
    second each. Nested uses (``largest_batches`` around ``find_max_batch_size``) freeze again on entry,
    and only the outermost exit unfreezes.
    """
    global _frozen_depth
    gc.freeze()
    _frozen_depth += 1
    try:
        yield
    finally:
        _frozen_depth -= 1
        if _frozen_depth == 0:
            gc.unfreeze()


def run_under_budget(step: Callable[[int], Any], batch_size: int, device: torch.device | str, budget_bytes: int,
                     *, include: Any = None) -> int | None:
    """Run ``step(batch_size)`` once under a memory budget; the peak bytes, or None if it ran out of memory.

    On CUDA the allocator's cache is emptied first, because the per-process limit is checked only when
    the allocator asks the driver for memory (cached blocks are reused unchecked) and counts reserved
    bytes, not allocated ones.

    Args:
        step: runs one training step at the batch size it is given.
        batch_size: the size to try (positive int).
        device: the device the step runs on.
        budget_bytes: the budget in bytes (tracker on CPU, per-process fraction of reserved bytes on CUDA).
        include: tensors alive before the step that count against the budget on the CPU (the
            model and the optimizer): the tracker's baseline.

    Returns:
        The peak bytes (baseline included on CPU; ``max_memory_allocated`` on CUDA), or None.

    Raises:
        ValueError: a bad batch size, or a budget that is not a positive int or exceeds the CUDA device.

    Example:
        >>> run_under_budget(step, 8, "cpu", 64 * 2**20, include=[model, optimizer])
    """
    device = torch.device(device)
    positive_int("batch_size", batch_size)
    check_budget(device, budget_bytes)
    if device.type == "cuda":
        torch.cuda.empty_cache()   # the limit is checked at cudaMalloc only: start from an empty cache
    ran = False
    peak = 0
    try:
        with measure_memory(device, timeline=False, include=include, budget_bytes=budget_bytes) as mem:
            step(batch_size)
        ran = True
        peak = mem.peak_bytes + mem.baseline_bytes
    except torch.OutOfMemoryError:
        pass  # keep no reference to the exception: its traceback holds the failed step's tensors
    return peak if ran else None


def find_max_batch_size(step: Callable[[int], Any], device: torch.device | str, budget_bytes: int, *,
                        model: nn.Module | None = None, optimizer: torch.optim.Optimizer | None = None,
                        start: int = 1, limit: int = 65536, guess: int | None = None) -> BatchSearch:
    """The largest batch size whose training step fits in a memory budget: double, then bisect.

    Why: the largest batch is what memory techniques buy; searching it by hand is slow, and a
    search that does not recover from out-of-memory properly finds too small a batch (the failed
    step's tensors, held by the exception's traceback, are still allocated during the next try).

    Args:
        step: ``step(batch_size)`` runs one full training step (forward, backward, optimizer step)
            on a batch of that size. It runs real updates: pass a copy of a model you care about.
        device: the device the step runs on.
        budget_bytes: the memory budget in bytes (positive int). On the CPU it counts the model and
            optimizer (``model``/``optimizer``, followed from before each try) plus what the step
            allocates; on CUDA it is a per-process fraction of the GPU and counts the bytes the
            caching allocator reserved (its cache is emptied before each try).
        model: the model being trained: its gradients are dropped after each try (a failed step can
            leave some behind) and, on CPU, its parameters count against the budget.
        optimizer: its state counts against the budget on the CPU.
        start: the first size tried (default 1).
        limit: the largest size tried (default 65536); the search stops there if it still runs.
        guess: a predicted answer (``predict_max_batch_size``), or None. The search tries it and the
            size above it first: when the guess runs and the size above does not, two tries settle
            it; otherwise the search goes on from what they showed (doubling, then bisecting).

    Returns:
        A ``BatchSearch``: ``largest`` ran and ``largest + 1`` did not (or ``largest == limit``).

    Raises:
        CapacityError: the step runs out of memory at ``start`` already.
        ValueError/TypeError: bad arguments (a CUDA budget above the card's memory included).

    Example:
        >>> found = find_max_batch_size(step, "cpu", 256 * 2**20, model=model, optimizer=optimizer)
        >>> found.largest, found.trials

    Known limitations:
        * A size that ran once is assumed to run again; a step whose memory varies between calls
          (data-dependent shapes) needs a margin.
        * On CUDA the budget includes the caching allocator's rounding and fragmentation; on CPU
          only tensor storage (not the allocator's own overhead, not oneDNN scratch space).
        * The tracker cannot see inside ``torch.compile``'d code: search eager code on the CPU.
    """
    if not callable(step):
        raise TypeError(f"step must be callable as step(batch_size), got {type(step).__name__}")
    device = torch.device(device)
    budget_bytes = check_budget(device, budget_bytes)
    start = positive_int("start", start)
    limit = positive_int("limit", limit)
    if start > limit:
        raise ValueError(f"start ({start}) must not exceed limit ({limit})")
    if guess is not None:
        guess = min(max(positive_int("guess", guess), start), limit)
    include = [obj for obj in (model, optimizer) if obj is not None]
    trials: list[tuple[int, bool]] = []
    peaks: dict[int, int] = {}

    def attempt(size: int) -> bool:
        peak = run_under_budget(step, size, device, budget_bytes, include=include)
        if model is not None:
            model.zero_grad(set_to_none=True)   # a failed backward leaves some gradients behind
        if peak is None:
            _release(device)                    # what the failed step left in reference cycles, and CUDA's cache
        trials.append((size, peak is not None))
        if peak is not None:
            peaks[size] = peak
        return peak is not None

    # the objects that exist now (the model, the library) are not garbage; each collection after a
    # failure then scans only what the search created, which makes it milliseconds, not half a second
    with _gc_frozen():
        return _search(attempt, start, limit, budget_bytes, trials, peaks, guess)


def _search(attempt: Callable[[int], bool], start: int, limit: int, budget_bytes: int,
            trials: list[tuple[int, bool]], peaks: dict[int, int], guess: int | None) -> BatchSearch:
    good: int | None = None
    bad: int | None = None
    if guess is not None:                      # confirm a prediction: the guess runs, the size above does not
        if attempt(guess):
            good = guess
            if guess < limit and attempt(guess + 1):
                good = guess + 1
            elif guess < limit:
                bad = guess + 1
        else:
            bad = guess
    if good is None:
        if bad == start or not attempt(start):
            raise CapacityError(f"a training step at batch size {start} does not fit in the budget of "
                                f"{budget_bytes:,} bytes ({budget_bytes / 2**20:,.2f} MiB): raise the budget or "
                                f"shrink the model (its state alone may not fit)")
        good = start
    while bad is None and good < limit:        # double until out of memory
        size = min(2 * good, limit)
        if attempt(size):
            good = size
        else:
            bad = size
    while bad is not None and bad - good > 1:  # bisect: good ran, bad did not
        middle = (good + bad) // 2
        if attempt(middle):
            good = middle
        else:
            bad = middle
    return BatchSearch(largest=good, first_failure=bad, trials=tuple(trials), peak_bytes=dict(peaks),
                       budget_bytes=budget_bytes)


@dataclass(frozen=True)
class TechniqueCapacity:
    """Predicted and found largest batch of one configuration of a training step.

    Attributes:
        predicted: the largest batch predicted from the model state and two small measured batches.
        search: the search's result (``search.largest`` is the size found).
        state_bytes: predicted model state (weights, gradients, AdamW state), ``utils.predict_model_state``.
        per_sample_bytes: peak bytes each extra sample adds (measured between two small batches).
        fixed_bytes: the rest of the peak at the small batch, beyond state and samples (may be
            negative: not all gradients are alive at the peak).
    """

    predicted: int
    search: BatchSearch
    state_bytes: int
    per_sample_bytes: int
    fixed_bytes: int

    @property
    def found(self) -> int:
        """The largest batch that ran."""
        return self.search.largest


def predict_max_batch_size(state_bytes: int, peak_small: int, peak_double: int, small_batch: int,
                           budget_bytes: int) -> tuple[int, int, int]:
    """Predict the largest batch from model state and the peaks measured at ``b`` and ``2b``.

    The peak of a training step is linear in the batch: ``state + fixed + B * per_sample``. Two
    small batches measure ``per_sample`` (their difference over ``b``) and ``fixed`` (the rest);
    the prediction is the largest ``B`` for which that line stays within the budget.

    Returns:
        ``(predicted_batch, per_sample_bytes, fixed_bytes)``; ``predicted_batch`` is 0 when not even
        one sample fits.

    Raises:
        ValueError: ``small_batch`` is not a positive int, or the peak did not grow with the batch.

    Example:
        >>> predict_max_batch_size(1000, 1450, 1850, 4, 2284)
        (12, 100, 50)
    """
    small_batch = positive_int("small_batch", small_batch)
    per_sample = (peak_double - peak_small) // small_batch
    if per_sample <= 0:
        raise ValueError(f"the peak did not grow with the batch ({peak_small:,} -> {peak_double:,} bytes): "
                         "measure at larger batches, where activations dominate the peak")
    fixed = peak_small - state_bytes - small_batch * per_sample
    predicted = max(0, math.floor((budget_bytes - state_bytes - fixed) / per_sample))
    return predicted, per_sample, fixed


def largest_batches(configurations: Mapping[str, StepFactory], device: torch.device | str, budget_bytes: int, *,
                    small_batch: int = 16, limit: int = 65536) -> dict[str, TechniqueCapacity]:
    """Predict, then search, the largest batch of each configuration of a reader's own training step.

    Each configuration is a function that builds a fresh model and optimizer and returns
    ``(step, model, optimizer)``, where ``step(batch_size)`` runs one full training step (the
    reader's code: autocast, checkpointing, accumulation, whatever the configuration uses). For each,
    one step at batch 1 creates the optimizer state; the peaks at ``small_batch`` and twice it
    give the prediction (measured whole by the CPU tracker, even past the budget; under the budget on
    CUDA); then ``find_max_batch_size`` searches, trying the prediction first (two tries when it is
    right, the whole doubling and bisection when it is not).

    Args:
        configurations: name -> factory, as above (called once each).
        device: where the steps run.
        budget_bytes: the memory budget in bytes.
        small_batch: the prediction measures the peaks at this batch and twice it: large enough that
            the phase that sets the peak near the budget (often the recomputation, with checkpointing)
            sets it at the probes too; on CUDA small enough that twice it fits the budget.
        limit: the largest batch the search tries.

    Returns:
        name -> ``TechniqueCapacity`` (predicted and found largest batch).

    Raises:
        CapacityError: on CUDA, a probe at ``small_batch`` or ``2 * small_batch`` does not fit the budget.
        TypeError: a configuration is not callable or does not return ``(step, model, optimizer)``.

    Example:
        >>> def fp32():
        ...     model = MyNet().to(dev); optimizer = torch.optim.AdamW(model.parameters())
        ...     return (lambda b: my_step(model, optimizer, *make_batch(b))), model, optimizer
        >>> found = largest_batches({"fp32": fp32}, dev, 2 * 2**30)
        >>> found["fp32"].found

    Known limitations:
        Each configuration's model trains for a few real steps. The prediction assumes the peak is
        linear in the batch (true for fixed-shape models; false with data-dependent shapes).
    """
    device = torch.device(device)
    budget_bytes = check_budget(device, budget_bytes)
    small_batch = positive_int("small_batch", small_batch)
    results: dict[str, TechniqueCapacity] = {}
    with _gc_frozen():   # each configuration's release below then scans only that configuration's objects
        for name, factory in configurations.items():
            if not callable(factory):
                raise TypeError(f"configurations[{name!r}] must be a function returning (step, model, optimizer), "
                                f"got {type(factory).__name__}")
            built = factory()
            if not (isinstance(built, tuple) and len(built) == 3 and callable(built[0])
                    and isinstance(built[1], nn.Module) and isinstance(built[2], torch.optim.Optimizer)):
                raise TypeError(f"configurations[{name!r}]() must return (step, model, optimizer)")
            step, model, optimizer = built
            step(1)                                          # creates the optimizer state before measuring
            model.zero_grad(set_to_none=True)
            state = predict_model_state(model, "adamw").total_bytes
            peaks = []
            for size in (small_batch, 2 * small_batch):
                # the tracker cannot run out: it measures the probes whole, even past the budget; on CUDA
                # they run under the budget, so that a probe never takes the card's memory
                probe_budget = budget_bytes if device.type == "cuda" else 2**62
                peak = run_under_budget(step, size, device, probe_budget, include=[model, optimizer])
                model.zero_grad(set_to_none=True)
                if peak is None:
                    raise CapacityError(f"configuration {name!r}: the prediction's probe at batch {size} does not "
                                        f"fit the budget of {budget_bytes / 2**20:,.1f} MiB: pass a smaller "
                                        "small_batch (or a larger budget)")
                peaks.append(peak)
            predicted, per_sample, fixed = predict_max_batch_size(state, peaks[0], peaks[1], small_batch, budget_bytes)
            search = find_max_batch_size(step, device, budget_bytes, model=model, optimizer=optimizer, limit=limit,
                                         guess=max(1, predicted))
            results[name] = TechniqueCapacity(predicted, search, state, per_sample, fixed)
            del built, step, model, optimizer
            _release(device)
    return results


def what_to_try_first(capacities: Mapping[str, TechniqueCapacity], baseline: str = "fp32") -> str:
    """A sentence, computed from the results, naming the single technique that buys the most batch.

    Single techniques are the configurations whose name has no ``+`` (combinations have one).

    Args:
        capacities: what ``largest_batches`` returned.
        baseline: the name of the configuration without techniques.

    Raises:
        ValueError: no ``baseline`` entry, or no single technique besides it.
    """
    if baseline not in capacities:
        raise ValueError(f"capacities has no {baseline!r} entry to compare with; it has {sorted(capacities)}")
    base = capacities[baseline].found
    singles = {name: cap.found for name, cap in capacities.items() if name != baseline and "+" not in name}
    if not singles:
        raise ValueError("capacities holds no single technique besides the baseline")
    best = max(singles, key=singles.get)
    gain = singles[best] / base
    if gain <= 1.0:
        return (f"no single technique raised the largest batch above {baseline}'s {base}: the model state, not "
                f"the activations, fills the budget; try a leaner optimizer or sharding first")
    return (f"try {best} first: alone it raised the largest batch from {base} to {singles[best]} "
            f"({gain:.2f}x), the most of any single technique here")
