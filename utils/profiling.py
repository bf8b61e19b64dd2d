"""Finding where a training step's time goes: profiler ranges, trace files, data waits, FLOPs, workers.

Introduced in notebook 06. The notebook profiles a training step with ``torch.profiler``, reads
the per-range times back (from the profiler object and from the Chrome trace it wrote), times how
long the loop waits for its DataLoader, counts FLOPs analytically to check torch's own counters,
and turns measured costs into a ``num_workers`` recommendation and a bottleneck verdict.

The Dataset and ``worker_init_fn`` live here, not in the notebook, because DataLoader workers
started with the ``spawn`` or ``forkserver`` methods (macOS, Windows, Python 3.14's Linux default)
re-import them by name: a class defined in a notebook cell cannot be pickled into those workers.
"""

from __future__ import annotations

import json
import math
import random
import time
from pathlib import Path
from typing import Any, Iterable, Iterator, Mapping, Sequence

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn
from torch.autograd import DeviceType
from torch.utils.data import Dataset, get_worker_info

from .checks import non_negative_int, positive_int, positive_number

__all__ = [
    "BOTTLENECK_VERDICTS", "OVERHEAD_VERDICT", "DataWaitTimer", "RandomDrawDataset", "SyntheticImageDataset",
    "classify_bottleneck", "linear_arithmetic_intensity", "linear_flops", "range_median_ms", "range_times_ms",
    "recommend_num_workers", "seed_worker", "step_breakdown_ms", "validate_trace", "workers_needed",
]




def _names(names: Sequence[str]) -> list[str]:
    if isinstance(names, str) or not isinstance(names, Sequence) or not names:
        raise TypeError(f"names must be a non-empty list of range names (strings), got {names!r}")
    if not all(isinstance(name, str) and name for name in names):
        raise TypeError(f"every range name must be a non-empty string, got {list(names)!r}")
    return list(names)


# --- data: a Dataset that does real CPU work per sample ---------------------------------------------

class SyntheticImageDataset(Dataset):
    """Images stored as raw bytes, decoded and augmented on every access, like a real image folder.

    Each sample is kept as ``image_size * image_size * 3`` bytes (what a decoded JPEG holds). Every
    ``__getitem__`` does the CPU work a vision pipeline does: bytes to a uint8 array, to a float
    (3, H, W) tensor in [0, 1], ``decode_passes`` 3x3 smoothing passes (a stand-in for the cost of
    a JPEG decoder: raise it to make samples dearer), a random crop, a random horizontal flip and a
    per-channel normalisation. Crops and flips draw from torch's global generator, which the
    DataLoader seeds differently in every worker.

    Args:
        num_samples: how many images.
        image_size: stored images are ``image_size`` x ``image_size`` pixels, RGB.
        crop_size: side of the random crop returned (<= ``image_size``).
        num_classes: labels are drawn uniformly from ``range(num_classes)``.
        decode_passes: smoothing passes per sample (0 or more): the per-sample cost knob.
        seed: seeds the stored bytes and labels (not the augmentations).

    Returns (per item):
        ``(image, label)``: float32 (3, crop_size, crop_size), normalised; int64 scalar.

    Example:
        >>> dataset = SyntheticImageDataset(256, image_size=40, crop_size=32, decode_passes=2)
        >>> loader = torch.utils.data.DataLoader(dataset, batch_size=32, num_workers=2)
    """

    MEAN = (0.5, 0.5, 0.5)
    STD = (0.25, 0.25, 0.25)

    def __init__(self, num_samples: int, *, image_size: int = 40, crop_size: int = 32, num_classes: int = 10,
                 decode_passes: int = 1, seed: int = 0) -> None:
        for name, value in [("num_samples", num_samples), ("image_size", image_size), ("crop_size", crop_size),
                            ("num_classes", num_classes)]:
            positive_int(name, value)
        non_negative_int("decode_passes", decode_passes)
        non_negative_int("seed", seed)
        if crop_size > image_size:
            raise ValueError(f"crop_size ({crop_size}) cannot exceed image_size ({image_size})")
        self.image_size = image_size
        self.crop_size = crop_size
        self.num_classes = num_classes
        self.decode_passes = decode_passes
        generator = torch.Generator().manual_seed(seed)
        pixels = torch.randint(0, 256, (num_samples, image_size, image_size, 3), dtype=torch.uint8,
                               generator=generator)
        self.blobs = [bytes(image.numpy().tobytes()) for image in pixels]     # one bytes object per image
        self.labels = torch.randint(0, num_classes, (num_samples,), generator=generator)
        self._mean = torch.tensor(self.MEAN).view(3, 1, 1)
        self._std = torch.tensor(self.STD).view(3, 1, 1)

    def __len__(self) -> int:
        return len(self.blobs)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        size, crop = self.image_size, self.crop_size
        pixels = np.frombuffer(self.blobs[index], dtype=np.uint8).reshape(size, size, 3)   # "decode": (H, W, 3)
        image = torch.from_numpy(pixels.copy()).permute(2, 0, 1).float().div_(255.0)       # (3, H, W) in [0, 1]
        for _ in range(self.decode_passes):
            image = F.avg_pool2d(image.unsqueeze(0), 3, stride=1, padding=1, count_include_pad=False).squeeze(0)
        top = int(torch.randint(0, size - crop + 1, ()))
        left = int(torch.randint(0, size - crop + 1, ()))
        image = image[:, top:top + crop, left:left + crop]                                 # (3, crop, crop)
        if bool(torch.rand(()) < 0.5):
            image = image.flip(-1)
        image = (image - self._mean) / self._std
        return image.contiguous(), self.labels[index]


class RandomDrawDataset(Dataset):
    """Returns, per item, one draw from each of three random sources and the worker that made them.

    Shows how DataLoader workers are seeded. The three sources:

    - torch's global generator (``torch.rand``): the DataLoader seeds it in every worker;
    - NumPy's legacy global state (``np.random.rand``): seeded in every worker too, since torch 1.9;
    - ``self.rng``, a ``np.random.Generator`` made in ``__init__``: every worker receives a *copy*
      of it in the same state, so all workers draw the same numbers, unless a ``worker_init_fn``
      (``seed_worker``) replaces it.

    Args:
        num_samples: items in the dataset.
        seed: seeds ``self.rng``.

    Returns (per item):
        a float64 tensor ``[index, worker_id, torch_draw, numpy_global_draw, generator_draw]``
        (worker_id is -1 in the main process). ``COLUMNS`` names the columns.
    """

    COLUMNS = ("index", "worker_id", "torch", "numpy_global", "numpy_generator")

    def __init__(self, num_samples: int, seed: int = 0) -> None:
        positive_int("num_samples", num_samples)
        non_negative_int("seed", seed)
        self.num_samples = num_samples
        self.rng = np.random.default_rng(seed)

    def __len__(self) -> int:
        return self.num_samples

    def __getitem__(self, index: int) -> torch.Tensor:
        info = get_worker_info()
        worker_id = -1 if info is None else info.id
        draws = [float(torch.rand(())), float(np.random.rand()), float(self.rng.random())]
        return torch.tensor([index, worker_id, *draws], dtype=torch.float64)


def seed_worker(worker_id: int) -> None:
    """A ``worker_init_fn`` that gives every worker its own, reproducible random streams.

    The DataLoader already seeds torch and Python's ``random`` in each worker with
    ``base_seed + worker_id`` (``base_seed`` is drawn from the loader's ``generator``), and, since
    torch 1.9, NumPy's legacy global state with a seed derived from the same two numbers. This
    function (PyTorch's documented recipe, extended) reseeds NumPy and ``random`` from torch's seed
    (what older torch versions needed) and replaces a ``np.random.Generator`` stored as
    ``dataset.rng``, which would otherwise be an identical copy in every worker.

    Args:
        worker_id: the worker's index (the DataLoader passes it).

    Example:
        >>> loader = DataLoader(dataset, num_workers=2, worker_init_fn=seed_worker,
        ...                     generator=torch.Generator().manual_seed(0))
    """
    non_negative_int("worker_id", worker_id)
    worker_seed = torch.initial_seed() % 2**32          # base_seed + worker_id, set by the DataLoader
    np.random.seed(worker_seed)
    random.seed(worker_seed)
    info = get_worker_info()
    if info is not None and isinstance(getattr(info.dataset, "rng", None), np.random.Generator):
        info.dataset.rng = np.random.default_rng(worker_seed)


# --- timing the wait for data -----------------------------------------------------------------------

class DataWaitTimer:
    """Wraps an iterable (a DataLoader) and measures how long each ``next()`` blocks the training loop.

    Time spent inside ``next(iterator)`` is time the model waits for data; time between receiving
    an item and asking for the next is the loop's own work (the training step). With enough
    workers the next batch is already prefetched and the wait is near zero; a starved loop waits
    for most of its step.

    Args:
        iterable: what to iterate (a DataLoader, a list, a generator).
        max_items: stop after this many items (None: run to the end of the iterable).

    Attributes:
        wait_ms: per item, milliseconds spent waiting in ``next()`` (the first includes creating
            the iterator, i.e. starting the workers).
        busy_ms: per item, milliseconds the consumer spent before asking for the next one.

    Example:
        >>> timer = DataWaitTimer(loader, max_items=20)
        >>> for images, labels in timer:
        ...     train_step(images, labels)
        >>> timer.wait_fraction()

    Known limitations:
        Measures host time. On CUDA a batch copied with ``non_blocking=True`` may still be in
        flight when ``next()`` returns; that wait shows up later, inside the step. ``busy_ms`` of
        the last item is only recorded when the loop asks for one more item (a ``for`` loop does;
        ``break`` does not).
    """

    def __init__(self, iterable: Iterable, max_items: int | None = None) -> None:
        if not hasattr(iterable, "__iter__"):
            raise TypeError(f"DataWaitTimer needs an iterable (e.g. a DataLoader), got {type(iterable).__name__}")
        if max_items is not None:
            positive_int("max_items", max_items)
        self.iterable = iterable
        self.max_items = max_items
        self.wait_ms: list[float] = []
        self.busy_ms: list[float] = []

    def __iter__(self) -> Iterator:
        self.wait_ms, self.busy_ms = [], []
        started = time.perf_counter()
        iterator = iter(self.iterable)     # starting workers happens here: counted in the first wait
        while self.max_items is None or len(self.wait_ms) < self.max_items:
            try:
                item = next(iterator)
            except StopIteration:
                return
            received = time.perf_counter()
            self.wait_ms.append((received - started) * 1e3)
            yield item
            started = time.perf_counter()
            self.busy_ms.append((started - received) * 1e3)

    @property
    def total_wait_ms(self) -> float:
        """All waits added up (ms)."""
        return float(sum(self.wait_ms))

    def _kept(self, skip: int) -> tuple[list[float], list[float]]:
        non_negative_int("skip", skip)
        completed = len(self.busy_ms)
        waits, busies = self.wait_ms[skip:completed], self.busy_ms[skip:completed]
        if not busies:
            raise ValueError(f"need at least {skip + 1} completed items to skip {skip} and measure "
                             f"(got {completed}); iterate further or skip fewer")
        return waits, busies

    def steady_step_ms(self, skip: int = 1) -> float:
        """Mean time per item (wait + busy, ms), leaving out the first ``skip`` items.

        Skip at least the first item (it includes start-up); with ``W`` workers, skip ``W``: each
        worker's first batch includes that worker's start.
        """
        waits, busies = self._kept(skip)
        return float((sum(waits) + sum(busies)) / len(busies))

    def wait_fraction(self, skip: int = 1) -> float:
        """Share of the loop's time spent waiting for data, leaving out the first ``skip`` items."""
        waits, busies = self._kept(skip)
        total = sum(waits) + sum(busies)
        if total <= 0:
            raise ValueError("the loop took no measurable time")
        return float(sum(waits) / total)


# --- reading profiler results --------------------------------------------------------------------------

def range_times_ms(prof: Any, names: Sequence[str]) -> dict[str, float]:
    """Total CPU time (ms) of each ``record_function`` range (or op) by name, from a finished profiler.

    Reads ``prof.key_averages()``: each entry's ``cpu_time_total`` is the range's wall time on the
    host, summed over every call in the profiler's active steps. On CUDA a ``record_function``
    range is listed twice, as a host row and as a GPU row (``gpu_user_annotation``); only host
    rows are added up, so the GPU row can neither hide the host time nor add to it.

    Args:
        prof: a ``torch.profiler.profile`` (or ``torch.autograd.profiler.profile``) after its run.
        names: the range names to read, e.g. ``["data", "forward", "backward", "optimizer"]``.

    Returns:
        name -> total milliseconds over the active steps (divide by their number for per step).

    Raises:
        TypeError: ``prof`` has no ``key_averages`` or ``names`` is not a list of strings.
        ValueError: a name was not recorded (the message lists what was).

    Example:
        >>> times = range_times_ms(prof, ["forward", "backward"])

    Known limitations:
        Host time only: on CUDA a range that launches kernels ends before they finish unless the
        code inside it synchronises. Do not profile with ``with_stack=True`` and
        ``record_function`` together on torch 2.13 CPU: ``key_averages()`` can then raise
        UnicodeDecodeError.
    """
    if not callable(getattr(prof, "key_averages", None)):
        raise TypeError(f"prof must be a torch.profiler.profile after its run, got {type(prof).__name__}")
    wanted = _names(names)
    totals: dict[str, float] = {}
    for entry in prof.key_averages():      # on CUDA one name has a host row and a GPU row (0 CPU time)
        if getattr(entry, "device_type", DeviceType.CPU) != DeviceType.CPU:
            totals.setdefault(entry.key, 0.0)          # a GPU row: recorded, but its time is not host time
            continue
        totals[entry.key] = totals.get(entry.key, 0.0) + entry.cpu_time_total
    missing = [name for name in wanted if name not in totals]
    if missing:
        ranges = sorted(key for key in totals if not key.startswith(("aten::", "autograd::")))
        raise ValueError(f"ranges {missing} were not recorded; recorded ranges include {ranges[:20]}")
    return {name: totals[name] / 1e3 for name in wanted}


def range_median_ms(prof: Any, name: str) -> float:
    """The median host time (ms) of one ``record_function`` range over its calls in a finished profiler.

    ``range_times_ms`` adds every call up; a median ignores the odd call that a busy machine stretched, which
    matters when a small time is compared with another (notebook 06's overhead twin against the roofline).

    Args:
        prof: a ``torch.profiler.profile`` after its run.
        name: the range's name, e.g. ``"forward"``.

    Returns:
        The median duration of the host-side events of that name, in ms.

    Raises:
        TypeError: ``prof`` has no ``events`` or ``name`` is not a string.
        ValueError: no host event of that name was recorded.

    Example:
        >>> overhead_ms = range_median_ms(twin_prof, "forward")
    """
    if not callable(getattr(prof, "events", None)):
        raise TypeError(f"prof must be a torch.profiler.profile after its run, got {type(prof).__name__}")
    (name,) = _names([name])
    durations = sorted(event.cpu_time_total / 1e3 for event in prof.events()
                       if event.name == name and getattr(event, "device_type", DeviceType.CPU) == DeviceType.CPU)
    if not durations:
        raise ValueError(f"no range named {name!r} was recorded on the host")
    middle = len(durations) // 2
    return durations[middle] if len(durations) % 2 else (durations[middle - 1] + durations[middle]) / 2


def _load_trace(trace: Mapping | str | Path) -> dict:
    if isinstance(trace, Mapping):
        return dict(trace)
    if not isinstance(trace, (str, Path)):
        raise TypeError("trace must be a path to a Chrome trace JSON file or its parsed dict, "
                        f"got {type(trace).__name__}")
    path = Path(trace)
    if not path.is_file():
        raise ValueError(f"no trace file at {path}")
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as error:
        raise ValueError(f"{path} is not valid JSON ({error}); was the trace written completely?") from error


def validate_trace(trace: Mapping | str | Path, required_names: Sequence[str] = ()) -> list[dict]:
    """Check that a file is a Chrome/Perfetto trace that holds the named ranges; return its events.

    A valid trace is a JSON object with a ``traceEvents`` list whose complete events (``ph == "X"``)
    each carry a name, a start ``ts`` and a non-negative duration ``dur`` (microseconds). This is
    what ``prof.export_chrome_trace`` writes and what ui.perfetto.dev and chrome://tracing open.

    Args:
        trace: the file's path, or the already-parsed JSON object.
        required_names: event names that must appear (e.g. your ``record_function`` ranges).

    Returns:
        The complete (``"X"``) events, sorted by start time.

    Raises:
        TypeError: ``trace`` is neither a path nor a dict.
        ValueError: the file is missing, not JSON, has no ``traceEvents`` list, has a malformed
            event, or lacks a required name (the message says which).
    """
    data = _load_trace(trace)
    events = data.get("traceEvents")
    if not isinstance(events, list) or not events:
        raise ValueError("not a Chrome trace: expected a non-empty 'traceEvents' list")
    complete = []
    for event in events:
        if not isinstance(event, dict):
            raise ValueError(f"malformed trace event (not an object): {event!r}")
        if event.get("ph") != "X":
            continue
        if not isinstance(event.get("name"), str) or not isinstance(event.get("ts"), (int, float)) \
                or not isinstance(event.get("dur"), (int, float)) or event["dur"] < 0:
            raise ValueError(f"malformed complete event (needs name, ts and dur >= 0): {event!r}")
        complete.append(event)
    if not complete:
        raise ValueError("the trace holds no complete ('X') events: nothing was recorded")
    present = {event["name"] for event in complete}
    missing = [name for name in required_names if name not in present]
    if missing:
        raise ValueError(f"the trace lacks the ranges {missing}")
    return sorted(complete, key=lambda event: event["ts"])


def step_breakdown_ms(trace: Mapping | str | Path, names: Sequence[str]) -> list[dict[str, float]]:
    """Per profiled step, the time (ms) in each named range, read from a trace file.

    Steps are the ``ProfilerStep#N`` ranges that ``prof.step()`` marks. Within each step, the
    host-side events with a wanted name (``record_function`` ranges, category
    ``user_annotation``) are added up; ``"other"`` is the rest of the step and ``"step"`` its
    whole duration. On CUDA traces, the GPU-side copies of the ranges (``gpu_user_annotation``)
    are left out.

    Args:
        trace: the trace's path, or its parsed JSON.
        names: the range names, e.g. ``["data", "forward", "backward", "optimizer"]``.

    Returns:
        One dict per step, in order: name -> ms, plus ``"other"`` and ``"step"``.

    Raises:
        ValueError: the trace is invalid, has no ``ProfilerStep#`` ranges, or lacks a name.
    """
    wanted = _names(names)
    events = validate_trace(trace, wanted)
    host = [event for event in events if event.get("cat") in (None, "user_annotation", "cpu_op")]
    steps = [event for event in host if event["name"].startswith("ProfilerStep#")]
    if not steps:
        raise ValueError("no ProfilerStep# ranges: profile with a schedule and call prof.step() every step")
    breakdown = []
    for step in steps:
        begin, end = step["ts"], step["ts"] + step["dur"]
        row = {name: 0.0 for name in wanted}
        for event in host:
            if event["name"] in row and begin <= event["ts"] and event["ts"] + event["dur"] <= end + 1e-3:
                row[event["name"]] += event["dur"] / 1e3
        row["step"] = step["dur"] / 1e3
        row["other"] = max(0.0, row["step"] - sum(row[name] for name in wanted))
        breakdown.append(row)
    return breakdown


# --- FLOPs and arithmetic intensity -------------------------------------------------------------------

def _linear_layers(model: nn.Module) -> list[nn.Linear]:
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be an nn.Module, got {type(model).__name__}")
    layers = [module for module in model.modules() if isinstance(module, nn.Linear)]
    if not layers:
        raise ValueError(f"{type(model).__name__} has no nn.Linear layers to count")
    return layers


def linear_flops(model: nn.Module, batch_size: int, *, input_requires_grad: bool = False) -> tuple[int, int]:
    """Analytic matmul FLOPs of one forward and one backward pass through a model's Linear layers.

    A Linear layer on a (B, in) input computes a (B, in) x (in, out) matmul: ``2 * B * in * out``
    FLOPs (one multiply and one add per term). Backward computes two matmuls of the same size: the
    weight gradient and the input gradient. The first layer's input gradient is skipped when the
    input does not require grad (data never does), so backward is ``2 - s`` times forward, where
    ``s`` is the first layer's share of the forward FLOPs (close to 1 when the first layer holds
    most of the weights, as in an MLP on flattened images). Bias adds, activations, the loss and
    the optimizer are not counted: neither ``FlopCounterMode`` nor the profiler's ``with_flops``
    counts them for this model.

    Args:
        model: a module whose Linear layers are applied in ``model.modules()`` order, each once,
            to (B, in_features) inputs (true of ``utils.MLP``).
        batch_size: rows B per step.
        input_requires_grad: whether the model's input requires grad (then the first layer's
            input gradient is computed too).

    Returns:
        ``(forward_flops, backward_flops)``.

    Example:
        >>> forward, backward = linear_flops(utils.MLP(784, 256, 10), batch_size=64)
    """
    positive_int("batch_size", batch_size)
    layers = _linear_layers(model)
    forward = sum(2 * batch_size * layer.in_features * layer.out_features for layer in layers)
    first = layers[0]
    skipped = 0 if input_requires_grad else 2 * batch_size * first.in_features * first.out_features
    return forward, 2 * forward - skipped


def linear_arithmetic_intensity(model: nn.Module, batch_size: int, bytes_per_element: int = 4) -> float:
    """FLOPs per byte of compulsory memory traffic of the forward matmuls: the roofline's x-axis.

    Each Linear must at least read its weight (in x out) and input (B x in) and write its output
    (B x out): ``bytes_per_element * (in*out + B*in + B*out)`` bytes for ``2*B*in*out`` FLOPs. For a
    small batch this is about B/2 FLOP per byte in fp32 (the weights dominate: bandwidth-bound);
    for a large batch it approaches ``in*out / (2*(in+out))`` (compute-bound on most hardware).

    Args:
        model: a module with Linear layers (each applied once per row).
        batch_size: rows B.
        bytes_per_element: 4 for fp32, 2 for bf16/fp16.

    Returns:
        Total forward FLOPs divided by total compulsory bytes (FLOP/byte).
    """
    positive_int("batch_size", batch_size)
    positive_int("bytes_per_element", bytes_per_element)
    layers = _linear_layers(model)
    flops = sum(2 * batch_size * layer.in_features * layer.out_features for layer in layers)
    traffic = sum(bytes_per_element * (layer.in_features * layer.out_features + batch_size * layer.in_features
                                       + batch_size * layer.out_features) for layer in layers)
    return flops / traffic


# --- from measurements to decisions -------------------------------------------------------------------

def workers_needed(sample_ms: float, batch_size: int, step_ms: float) -> float:
    """How many loader workers keep a model busy: batch preparation time over model step time.

    One worker makes a batch in ``batch_size * sample_ms``; the model eats one every ``step_ms``.
    Workers run in parallel, so ``batch_size * sample_ms / step_ms`` of them deliver batches as
    fast as the model consumes them (if each has a core of its own).

    Args:
        sample_ms: measured time to make one sample (ms, single thread).
        batch_size: samples per batch.
        step_ms: measured model step time with data already in memory (ms).

    Returns:
        The (fractional) number of workers; round up for a setting.
    """
    sample_ms = positive_number("sample_ms", sample_ms)
    positive_int("batch_size", batch_size)
    step_ms = positive_number("step_ms", step_ms)
    return batch_size * sample_ms / step_ms


def recommend_num_workers(sample_ms: float, batch_size: int, step_ms: float, cpu_count: int, *,
                          reserved_cores: int = 1) -> int:
    """A ``num_workers`` setting from measured costs, capped by the cores this machine has.

    ``ceil(workers_needed(...))``, but no more than ``cpu_count - reserved_cores`` (the training
    process itself needs a core: on a CPU it runs the model, on a GPU it launches kernels), and
    at least 0. More workers than cores only makes them take turns.

    Args:
        sample_ms, batch_size, step_ms: as for ``workers_needed``.
        cpu_count: cores available (``os.cpu_count()`` or ``len(os.sched_getaffinity(0))``).
        reserved_cores: cores kept for the training process.

    Returns:
        The recommended ``num_workers`` (0 means load in the main process).
    """
    positive_int("cpu_count", cpu_count)
    non_negative_int("reserved_cores", reserved_cores)
    needed = math.ceil(workers_needed(sample_ms, batch_size, step_ms) - 1e-9)
    return max(0, min(needed, cpu_count - reserved_cores))


BOTTLENECK_VERDICTS = ("data-bound", "bandwidth-bound", "compute-bound")
#: the verdict for a step whose time is mostly the fixed cost of its ops (Python, dispatch, kernel launches)
OVERHEAD_VERDICT = "overhead-bound"


def classify_bottleneck(data_wait_fraction: float, arithmetic_intensity: float, machine_balance: float, *,
                        data_threshold: float = 0.3, overhead_ms: float | None = None,
                        roofline_ms: float | None = None) -> str:
    """BEE-30091's three signatures as a rule applied to measurements, in its order (data first), with the
    overhead-bound regime that the roofline alone cannot see.

    - data-bound: the loop waits for data for at least ``data_threshold`` of its step;
    - overhead-bound (when ``overhead_ms`` and ``roofline_ms`` are given): the fixed cost of the part's ops alone
      (Python, dispatch, kernel launches: ``overhead_ms``, measured as the same sequence of ops on tensors too
      small to carry any work) is at least the time the roofline allows for its work (``roofline_ms``: its FLOPs
      over its roof, the lower of peak FLOP/s and bandwidth x intensity). Such a point sits far below its roof
      however high the roof is: neither more bandwidth nor more FLOP/s would speed it up, fewer launches would
      (notebook 05's third regime: fusion, CUDA graphs);
    - otherwise bandwidth-bound: the step's arithmetic intensity (FLOP/byte) is below the machine's balance
      point (measured peak FLOP/s divided by measured bytes/s), so memory traffic, not arithmetic, sets the
      pace (the roofline model);
    - otherwise compute-bound.

    Args:
        data_wait_fraction: share of the step spent waiting for data, in [0, 1].
        arithmetic_intensity: FLOPs per byte of the step's work (``linear_arithmetic_intensity``).
        machine_balance: peak FLOP/s divided by memory bandwidth in bytes/s (FLOP/byte).
        data_threshold: the data share above which data loading is the bottleneck.
        overhead_ms: the measured fixed cost of the part's ops (ms), or None when it was not measured.
        roofline_ms: the time the roofline allows for the part's work (ms); given with ``overhead_ms``.

    Returns:
        ``"data-bound"``, ``OVERHEAD_VERDICT`` (``"overhead-bound"``), ``"bandwidth-bound"`` or ``"compute-bound"``.

    Raises:
        ValueError: a share outside [0, 1], a non-positive intensity, balance or time, or only one of
            ``overhead_ms`` and ``roofline_ms``.

    Example:
        >>> classify_bottleneck(0.05, 1.0, 8.0, overhead_ms=0.2, roofline_ms=0.08)
        'overhead-bound'
    """
    if isinstance(data_wait_fraction, bool) or not isinstance(data_wait_fraction, (int, float)) \
            or not 0.0 <= data_wait_fraction <= 1.0:
        raise ValueError(f"data_wait_fraction must be a number in [0, 1], got {data_wait_fraction!r}")
    arithmetic_intensity = positive_number("arithmetic_intensity", arithmetic_intensity)
    machine_balance = positive_number("machine_balance", machine_balance)
    if isinstance(data_threshold, bool) or not isinstance(data_threshold, (int, float)) or not 0 < data_threshold < 1:
        raise ValueError(f"data_threshold must be in (0, 1), got {data_threshold!r}")
    if (overhead_ms is None) != (roofline_ms is None):
        raise ValueError("give overhead_ms and roofline_ms together (the fixed cost of the ops against the time the "
                         f"roofline allows), got overhead_ms={overhead_ms!r}, roofline_ms={roofline_ms!r}")
    if overhead_ms is not None:
        overhead_ms = positive_number("overhead_ms", overhead_ms)
        roofline_ms = positive_number("roofline_ms", roofline_ms)
    if data_wait_fraction >= data_threshold:
        return "data-bound"
    if overhead_ms is not None and overhead_ms >= roofline_ms:
        return OVERHEAD_VERDICT
    if arithmetic_intensity < machine_balance:
        return "bandwidth-bound"
    return "compute-bound"
