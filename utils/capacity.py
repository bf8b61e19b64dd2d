"""The largest batch that fits: a search under a memory budget, a prediction, and per-technique comparisons.

Introduced in notebook 13. ``find_max_batch_size`` doubles the batch size until a training step runs
out of memory, then bisects between the last size that ran and the first that did not (the search of
Lightning's ``BatchSizeFinder`` in ``binsearch`` mode and of accelerate's
``find_executable_batch_size``, which only halves). The budget is real on both devices: on CUDA
``torch.cuda.set_per_process_memory_fraction``, on the CPU the exact tracker of ``utils.memory``,
which raises ``torch.OutOfMemoryError`` when the tracked bytes would pass it, so the same search
runs on a laptop.

Recovering from out-of-memory properly matters more than the search: the exception's traceback
holds the frames of the failed step, and those frames hold its activations. The search keeps no
reference to the exception (it only notes that one happened, inside the ``except`` block, whose
name Python deletes on leaving it), drops the failed step's gradients, then calls ``gc.collect()``
and, on CUDA, ``torch.cuda.empty_cache()`` before the next try.

``largest_batches`` runs the search for several techniques (bf16 autocast, checkpointing every
block, a fused optimizer) on a reader's own model and batch function, and predicts each result
first from two small measured batches.
"""

from __future__ import annotations

import gc
import math
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Mapping

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from .checks import positive_int
from .footprint import predict_model_state
from .memory import measure_memory


class CapacityError(RuntimeError):
    """The memory budget is too small for the smallest batch the search tries."""


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

    Args:
        step: runs one training step at the batch size it is given.
        batch_size: the size to try.
        device: the device the step runs on.
        budget_bytes: the budget in bytes (tracker on CPU, per-process fraction on CUDA).
        include: tensors alive before the step that count against the budget on the CPU (the
            model and the optimizer): the tracker's baseline.

    Returns:
        The peak bytes (baseline included on CPU; ``max_memory_allocated`` on CUDA), or None.

    Example:
        >>> run_under_budget(step, 8, "cpu", 64 * 2**20, include=[model, optimizer])
    """
    device = torch.device(device)
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
                        start: int = 1, limit: int = 65536) -> BatchSearch:
    """The largest batch size whose training step fits in a memory budget: double, then bisect.

    Why: the largest batch is what memory techniques buy; searching it by hand is slow and a
    search that does not recover from out-of-memory properly finds too small a batch (the failed
    step's tensors, held by the exception's traceback, are still allocated during the next try).

    Args:
        step: ``step(batch_size)`` runs one full training step (forward, backward, optimizer step)
            on a batch of that size. It runs real updates: pass a copy of a model you care about.
        device: the device the step runs on.
        budget_bytes: the memory budget in bytes (positive int). On the CPU it counts the model and
            optimizer (``model``/``optimizer``, followed from before each try) plus what the step
            allocates; on CUDA it is a per-process fraction of the GPU and counts everything the
            process allocated on it.
        model: the model being trained: its gradients are dropped after each try (a failed step can
            leave some behind) and, on CPU, its parameters count against the budget.
        optimizer: its state counts against the budget on the CPU.
        start: the first size tried (default 1).
        limit: the largest size tried (default 65536); the search stops there if it still runs.

    Returns:
        A ``BatchSearch``: ``largest`` ran and ``largest + 1`` did not (or ``largest == limit``).

    Raises:
        CapacityError: the step runs out of memory at ``start`` already.
        ValueError/TypeError: bad arguments.

    Example:
        >>> found = find_max_batch_size(step, "cpu", 256 * 2**20, model=model, optimizer=optimizer)
        >>> found.largest, found.trials

    Known limitations:
        * A size that ran once is assumed to run again; a step whose memory varies between calls
          (data-dependent shapes) needs a margin.
        * On CUDA the budget includes the caching allocator's reserve and fragmentation; on CPU
          only tensor storage (not the allocator's own overhead, not oneDNN scratch space).
        * The tracker cannot see inside ``torch.compile``'d code: search eager code on the CPU.
    """
    if not callable(step):
        raise TypeError(f"step must be callable as step(batch_size), got {type(step).__name__}")
    device = torch.device(device)
    budget_bytes = positive_int("budget_bytes", budget_bytes)
    start = positive_int("start", start)
    limit = positive_int("limit", limit)
    if start > limit:
        raise ValueError(f"start ({start}) must not exceed limit ({limit})")
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
        return _search(attempt, start, limit, budget_bytes, trials, peaks)


def _search(attempt: Callable[[int], bool], start: int, limit: int, budget_bytes: int,
            trials: list[tuple[int, bool]], peaks: dict[int, int]) -> BatchSearch:
    if not attempt(start):
        raise CapacityError(f"a training step at batch size {start} does not fit in the budget of "
                            f"{budget_bytes:,} bytes ({budget_bytes / 2**20:,.2f} MiB): raise the budget or "
                            f"shrink the model (its state alone may not fit)")
    good, bad = start, None
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


class Checkpointed(nn.Module):
    """Wraps a module so that its forward is recomputed in backward (non-reentrant checkpoint).

    Args:
        module: the module whose activations are not kept (a transformer block, a conv block).
    """

    def __init__(self, module: nn.Module) -> None:
        super().__init__()
        if not isinstance(module, nn.Module):
            raise TypeError(f"expected an nn.Module, got {type(module).__name__}")
        self.module = module

    def forward(self, *args: Any) -> Any:
        return checkpoint(self.module, *args, use_reentrant=False)


def checkpoint_each(blocks: nn.ModuleList | nn.Sequential) -> nn.ModuleList | nn.Sequential:
    """The same container with every block wrapped in ``Checkpointed`` (the weights are shared, not copied).

    Example:
        >>> model.blocks = checkpoint_each(model.blocks)
    """
    if not isinstance(blocks, (nn.ModuleList, nn.Sequential)):
        raise TypeError(f"expected an nn.ModuleList or nn.Sequential of blocks, got {type(blocks).__name__}")
    wrapped = [Checkpointed(block) for block in blocks]
    return nn.Sequential(*wrapped) if isinstance(blocks, nn.Sequential) else nn.ModuleList(wrapped)


def make_train_step(model: nn.Module, optimizer: torch.optim.Optimizer,
                    make_batch: Callable[[int], tuple[Any, torch.Tensor]],
                    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor], *,
                    autocast_dtype: torch.dtype | None = None, micro_batches: int = 1) -> Callable[[int], float]:
    """A function ``step(batch_size)`` that runs one training step; returns the loss as a float.

    Args:
        model: the model (already on its device).
        optimizer: its optimizer.
        make_batch: ``make_batch(batch_size) -> (inputs, targets)`` on the model's device.
        loss_fn: ``loss_fn(outputs, targets) -> scalar``.
        autocast_dtype: run forward under ``torch.autocast`` in this dtype (``torch.bfloat16``), or None.
        micro_batches: gradient accumulation: each step runs this many micro-batches of
            ``batch_size`` (the loss divided by their number) before one optimizer step.

    Example:
        >>> step = make_train_step(model, optimizer, batch_fn, nn.functional.cross_entropy)
        >>> loss = step(32)
    """
    positive_int("micro_batches", micro_batches)
    device_type = next(model.parameters()).device.type

    def step(batch_size: int) -> float:
        total = 0.0
        for _ in range(micro_batches):
            inputs, targets = make_batch(batch_size)
            with torch.autocast(device_type, dtype=autocast_dtype or torch.float32,
                                enabled=autocast_dtype is not None):
                outputs = model(inputs)
            loss = loss_fn(outputs.float(), targets) / micro_batches
            loss.backward()
            total += loss.item()
            del inputs, targets, outputs, loss
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return total

    return step


@dataclass(frozen=True)
class Technique:
    """One configuration of the training step.

    Attributes:
        bf16: forward under bf16 autocast.
        checkpoint: every block of ``model.<blocks>`` checkpointed.
        fused: ``AdamW(fused=True)`` instead of the default implementation.
    """

    bf16: bool = False
    checkpoint: bool = False
    fused: bool = False


TECHNIQUES: dict[str, Technique] = {
    "fp32": Technique(),
    "bf16 autocast": Technique(bf16=True),
    "checkpoint every block": Technique(checkpoint=True),
    "fused AdamW": Technique(fused=True),
    "bf16 + checkpoint": Technique(bf16=True, checkpoint=True),
    "bf16 + checkpoint + fused AdamW": Technique(bf16=True, checkpoint=True, fused=True),
}


@dataclass(frozen=True)
class TechniqueCapacity:
    """Predicted and found largest batch of one technique.

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
    """
    small_batch = positive_int("small_batch", small_batch)
    per_sample = (peak_double - peak_small) // small_batch
    if per_sample <= 0:
        raise ValueError(f"the peak did not grow with the batch ({peak_small:,} -> {peak_double:,} bytes): "
                         "measure at larger batches, where activations dominate the peak")
    fixed = peak_small - state_bytes - small_batch * per_sample
    predicted = max(0, math.floor((budget_bytes - state_bytes - fixed) / per_sample))
    return predicted, per_sample, fixed


def build_technique(build_model: Callable[[], nn.Module], technique: Technique, *, blocks: str = "blocks",
                    lr: float = 1e-3) -> tuple[nn.Module, torch.optim.Optimizer]:
    """A fresh model and AdamW optimizer configured for ``technique`` (checkpointing, fused)."""
    model = build_model()
    if technique.checkpoint:
        if not hasattr(model, blocks):
            raise ValueError(f"checkpointing needs the model's blocks as model.{blocks} (a ModuleList/Sequential)")
        setattr(model, blocks, checkpoint_each(getattr(model, blocks)))
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, fused=True if technique.fused else None)
    return model, optimizer


def largest_batches(build_model: Callable[[], nn.Module], make_batch: Callable[[int], tuple[Any, torch.Tensor]],
                    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor], device: torch.device | str,
                    budget_bytes: int, *, techniques: Mapping[str, Technique] | None = None,
                    blocks: str = "blocks", small_batch: int = 16, limit: int = 65536) -> dict[str, TechniqueCapacity]:
    """Predict, then search, the largest batch of each technique on a reader's own model.

    Args:
        build_model: returns a fresh model on ``device`` (called once per technique).
        make_batch: ``make_batch(batch_size) -> (inputs, targets)`` on ``device``.
        loss_fn: ``loss_fn(outputs, targets) -> scalar loss``.
        device: where to train.
        budget_bytes: the memory budget in bytes.
        techniques: name -> ``Technique`` (default ``TECHNIQUES``).
        blocks: the attribute holding the model's blocks, for checkpointing.
        small_batch: the prediction measures the peaks at this batch and twice it.
        limit: the largest batch the search tries.

    Returns:
        name -> ``TechniqueCapacity`` (predicted and found largest batch).

    Example:
        >>> found = largest_batches(lambda: MyNet().to(dev), batch_fn, F.cross_entropy, dev, 2 * 2**30)
        >>> {name: c.found for name, c in found.items()}

    Known limitations:
        Each technique's model trains for a few real steps. The prediction assumes the peak is
        linear in the batch (true for fixed-shape models; false with data-dependent shapes).
    """
    device = torch.device(device)
    results: dict[str, TechniqueCapacity] = {}
    with _gc_frozen():   # each technique's release below then scans only that technique's objects
        for name, technique in (TECHNIQUES if techniques is None else techniques).items():
            if not isinstance(technique, Technique):
                raise TypeError(f"techniques[{name!r}] must be a utils.capacity.Technique, "
                                f"got {type(technique).__name__}")
            model, optimizer = build_technique(build_model, technique, blocks=blocks)
            step = make_train_step(model, optimizer, make_batch, loss_fn,
                                   autocast_dtype=torch.bfloat16 if technique.bf16 else None)
            step(1)                                          # creates the optimizer state before measuring
            state = predict_model_state(model, "adamw").total_bytes
            peaks = []
            for size in (small_batch, 2 * small_batch):
                peak = run_under_budget(step, size, device, 2**62, include=[model, optimizer])
                if peak is None:   # no budget was set: the device itself ran out of memory
                    raise CapacityError(f"technique {name!r}: a training step at batch {size} (the prediction's "
                                        f"probe) ran out of the device's own memory; pass a smaller small_batch")
                peaks.append(peak)
            predicted, per_sample, fixed = predict_max_batch_size(state, peaks[0], peaks[1], small_batch, budget_bytes)
            search = find_max_batch_size(step, device, budget_bytes, model=model, optimizer=optimizer, limit=limit)
            results[name] = TechniqueCapacity(predicted, search, state, per_sample, fixed)
            del model, optimizer, step
            _release(device)
    return results


def what_to_try_first(capacities: Mapping[str, TechniqueCapacity], baseline: str = "fp32") -> str:
    """A sentence, computed from the results, naming the single technique that buys the most batch.

    Args:
        capacities: what ``largest_batches`` returned.
        baseline: the name of the configuration without techniques.
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
