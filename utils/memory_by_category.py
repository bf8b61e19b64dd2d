"""Memory by category and by module: a thin, typed wrapper around torch's own ``MemTracker``.

Introduced in notebook 07. ``torch.distributed._tools.mem_tracker.MemTracker`` (a
``TorchDispatchMode``, despite its package it needs no process group and runs on the CPU) labels
every tensor storage as a parameter, buffer, gradient, activation, temporary, optimizer state or
"other", and records each module's peak during forward and backward. Its results come as nested
dictionaries keyed by private enums; ``measure_memory_by_category`` runs one region under it and
returns plain names and integers that a notebook can assert on and plot.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from .env import device_name

CATEGORIES = ("Parameter", "Buffer", "Gradient", "Activation", "Temp", "Optstate", "Other")


def _plain(key: Any) -> str:
    """MemTracker's keys are str-Enums (hashed by name, not value): compare by their value."""
    return str(getattr(key, "value", key))


@dataclass(frozen=True)
class CategoryPeaks:
    """One region's memory by category at its peak, and each module's peaks.

    Attributes:
        device: the device's human name.
        peak_bytes: all tracked bytes at the region's peak (what existed before, if tracked, included).
        peak_by_category: the same peak split by category (``CATEGORIES``); sums to ``peak_bytes``.
        module_forward_peak_bytes: module name -> highest total while its forward ran.
        module_backward_peak_bytes: module name -> highest total while its backward ran.
        marks: name -> by-category snapshot taken by ``mark(name)`` inside the region.
    """

    device: str
    peak_bytes: int
    peak_by_category: dict[str, int]
    module_forward_peak_bytes: dict[str, int] = field(default_factory=dict)
    module_backward_peak_bytes: dict[str, int] = field(default_factory=dict)
    marks: dict[str, dict[str, int]] = field(default_factory=dict)


def measure_memory_by_category(region: Callable[[Callable[[str], None]], object], *track: Any,
                               device: torch.device | str = "cpu") -> CategoryPeaks:
    """Run ``region`` under torch's ``MemTracker`` and return its peak by category and per module.

    Why it exists: ``utils.measure_memory`` says how much; this says *what* (parameters,
    gradients, activations, optimizer state, temporaries) and *where* (which module was running).
    The two must agree on the total; notebook 07 asserts it on the CPU.

    Args:
        region: a function of one argument, ``mark``; call ``mark("after forward")`` inside it to
            keep a by-category snapshot at that moment. Run one training step in it: MemTracker
            refuses a root module called twice in one region.
        *track: modules, optimizers and tensors created *before* the region that should count
            (the model, its optimizer, the batch); anything else made earlier is invisible.
        device: the device whose memory to report ("cpu", "cuda", "cuda:1", a ``torch.device``);
            without an index, every device of that type is summed.

    Returns:
        A ``CategoryPeaks``.

    Raises:
        TypeError: ``region`` is not callable, ``device`` is not a string or ``torch.device``, or
            ``track`` holds something MemTracker cannot follow (it accepts modules, optimizers,
            tensors).
        ImportError: this torch build has no ``torch.distributed`` (MemTracker lives there).

    Example:
        >>> def step(mark):
        ...     loss = loss_fn(model(x), y); mark("forward")
        ...     loss.backward(); optimizer.step(); optimizer.zero_grad()
        >>> peaks = measure_memory_by_category(step, model, optimizer, x, y)
        >>> peaks.peak_by_category["Gradient"]

    Known limitations:
        * Everything allocated inside ``optimizer.step()`` is labelled "Optstate", including the
          step's temporaries; tensors made in backward start as "Temp" and become "Gradient" when
          autograd accumulates them.
        * On CUDA every storage is rounded up to 512 bytes, as the caching allocator does; the
          allocator's own figure can still differ (block splitting, workspaces).
        * Tensor storage only (as ``utils.measure_memory``'s tracker); torch.compile'd code runs
          below the dispatcher and is not seen.
    """
    if not callable(region):
        raise TypeError(f"region must be callable (it receives `mark`), got {type(region).__name__}")
    if not isinstance(device, (str, torch.device)):
        raise TypeError(f"device must be a string or torch.device, not {type(device).__name__}")
    try:
        from torch.distributed._tools.mem_tracker import MemTracker
    except ImportError as error:  # pragma: no cover - builds without torch.distributed
        raise ImportError("MemTracker needs a torch build with torch.distributed") from error
    device = torch.device(device)
    tracker = MemTracker()
    tracker.track_external(*track)
    marks: dict[str, dict[str, int]] = {}

    def mark(name: str) -> None:
        if not isinstance(name, str) or not name:
            raise ValueError(f"a mark needs a non-empty name, got {name!r}")
        marks[name] = _by_category(tracker.get_tracker_snapshot("current"), device)

    with tracker:
        region(mark)
    peak = _by_category(tracker.get_tracker_snapshot("peak"), device)
    forward: dict[str, int] = {}
    backward: dict[str, int] = {}
    for stats in tracker.memory_tracking.values():
        for state, snapshots in stats.snapshots.items():
            target = {"Peak-Forward": forward, "Peak-Backward": backward}.get(_plain(state))
            if target is None:
                continue
            for snapshot in snapshots:
                total = _by_category(snapshot, device)["Total"]
                target[stats.mod_fqn] = max(target.get(stats.mod_fqn, 0), total)
    total = peak.pop("Total")
    return CategoryPeaks(device=device_name(device), peak_bytes=total, peak_by_category=peak,
                         module_forward_peak_bytes=forward, module_backward_peak_bytes=backward,
                         marks=marks)


def _by_category(snapshot: dict, device: torch.device) -> dict[str, int]:
    """One device's snapshot as {category: bytes, "Total": bytes}, every category present."""
    result = dict.fromkeys(CATEGORIES, 0)
    result["Total"] = 0
    for snap_device, categories in snapshot.items():
        snap_device = torch.device(snap_device)
        if snap_device.type != device.type or (device.index is not None and snap_device.index != device.index):
            continue
        for key, value in categories.items():
            result[_plain(key)] = result.get(_plain(key), 0) + int(value)
    return result
