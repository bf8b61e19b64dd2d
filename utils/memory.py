"""Measuring memory: one context manager, the CUDA allocator's figures or an exact CPU tracker.

Introduced in notebook 00. ``measure_memory`` works the same way on every device and returns the
same result: what was live at the start (baseline), the highest point above it (peak), what the
region left behind (end), and a timeline of samples labelled with phases ("forward", "backward",
"optimizer") that ``utils.plots.plot_memory_timeline`` draws.

How each backend measures:

* ``"cuda-allocator"`` (default on CUDA): ``torch.cuda.memory_allocated`` / ``max_memory_allocated``
  / ``max_memory_reserved`` after ``reset_peak_memory_stats``. The peak includes short-lived
  workspaces inside kernels; the timeline is sampled after every aten operation.
* ``"tracker"`` (default on CPU, available on CUDA too): a ``TorchDispatchMode`` sees every tensor
  an aten operation returns, follows its storage, and a weakref finalizer subtracts the bytes when
  the storage dies. Every allocation and every free is one timeline sample, so the result is exact
  for tensor storage: on the CPU, parameter, gradient and optimizer-state bytes equal the analytic
  prediction to the byte.
"""

from __future__ import annotations

import threading
import weakref
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

import torch
from torch.utils._python_dispatch import TorchDispatchMode, is_traceable_wrapper_subclass

from .env import device_name

MIB = 1024**2
BACKENDS = ("auto", "cuda-allocator", "tracker")


def to_mib(num_bytes: float) -> float:
    """Bytes to MiB (2**20 bytes), the unit every plot and table in the course uses."""
    return num_bytes / MIB


def tensor_bytes(tensors: Any) -> int:
    """Bytes of the distinct storages behind some tensors (views of one storage count once).

    Args:
        tensors: a tensor, an ``nn.Module`` (its parameters, their gradients and its buffers), an
            optimizer (its state tensors), or any nesting of lists, tuples and dicts of these.

    Returns:
        The sum of ``untyped_storage().nbytes()`` over distinct storages.
    """
    seen: dict[int, int] = {}
    for tensor in _iter_tensors(tensors):
        storage = tensor.untyped_storage()
        seen[storage._cdata] = storage.nbytes()
    return sum(seen.values())


def _iter_tensors(obj: Any) -> Iterator[torch.Tensor]:
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, torch.nn.Module):
        for param in obj.parameters():
            yield param
            if param.grad is not None:
                yield param.grad
        yield from obj.buffers()
    elif isinstance(obj, torch.optim.Optimizer):
        for state in obj.state.values():
            yield from _iter_tensors(state)
    elif isinstance(obj, dict):
        for value in obj.values():
            yield from _iter_tensors(value)
    elif isinstance(obj, (list, tuple, set)):
        for value in obj:
            yield from _iter_tensors(value)
    elif obj is None or isinstance(obj, (int, float, bool, str)):
        return
    else:
        raise TypeError(
            "expected tensors, an nn.Module, an optimizer, or lists/tuples/dicts of them, "
            f"not {type(obj).__name__}"
        )


@dataclass(frozen=True)
class MemorySample:
    """One point of a memory timeline.

    Attributes:
        event: the sample's number within the region (0, 1, 2, ...).
        phase: the phase label current when the sample was taken.
        bytes: bytes allocated above the region's baseline at that moment.
    """

    event: int
    phase: str
    bytes: int


@dataclass
class MemoryMeasurement:
    """What ``measure_memory`` yields; its figures are filled in when the ``with`` block ends.

    Attributes:
        device: the device's human name (GPU model, or CPU and thread count).
        backend: ``"cuda-allocator"`` or ``"tracker"``.
        baseline_bytes: bytes already allocated when the region started. The CUDA allocator knows
            this; the tracker only sees what the region allocates, so it reports 0.
        peak_bytes: highest allocation above the baseline during the region.
        end_bytes: allocation above the baseline when the region ended (what it left alive).
        reserved_peak_bytes: CUDA only, the caching allocator's highest reserve (what nvidia-smi
            sees, minus the CUDA context); None for the tracker.
        timeline: samples in order, each with its phase.
    """

    device: str
    backend: str
    baseline_bytes: int = 0
    peak_bytes: int = 0
    end_bytes: int = 0
    reserved_peak_bytes: int | None = None
    timeline: list[MemorySample] = field(default_factory=list)
    _phase: str = "region"
    _finished: bool = False
    _sample_now: Callable[[], None] | None = field(default=None, repr=False, compare=False)

    def phase(self, name: str) -> None:
        """Label the samples that follow with ``name`` (e.g. "backward" before ``loss.backward()``).

        Inside a region measured by the CUDA allocator, the outgoing phase first gets a fresh sample of
        ``memory_allocated``: that backend samples after each aten op, so without it the outgoing phase
        would end on its last op's sample, and a tensor freed after that op (``del loss``, a temporary
        dropped when a function returns) would still be counted in it. The tracker sees every free as it
        happens and needs no extra sample.
        """
        if not isinstance(name, str) or not name:
            raise ValueError(f"a phase name must be a non-empty string, got {name!r}")
        if self._sample_now is not None:
            self._sample_now()
        self._phase = name

    @property
    def peak_mib(self) -> float:
        """``peak_bytes`` in MiB."""
        return to_mib(self.peak_bytes)

    @property
    def end_mib(self) -> float:
        """``end_bytes`` in MiB."""
        return to_mib(self.end_bytes)

    def phase_peak_bytes(self) -> dict[str, int]:
        """The highest level of each phase, in order of first appearance.

        A phase starts at the level the previous one left (0 for the region's first phase, the baseline), so
        that level counts too: a phase that only frees peaks where it began, not at its first sample after
        a free.
        """
        peaks: dict[str, int] = {}
        level, current_phase = 0, None
        for sample in self.timeline:
            if sample.phase != current_phase:      # entering a phase (again): it starts at the level left
                current_phase = sample.phase
                peaks[current_phase] = max(peaks.get(current_phase, level), level)
            peaks[current_phase] = max(peaks[current_phase], sample.bytes)
            level = sample.bytes
        return peaks

    def phase_end_bytes(self) -> dict[str, int]:
        """The last sample of each phase: what was live when that phase handed over to the next."""
        ends: dict[str, int] = {}
        for sample in self.timeline:
            ends[sample.phase] = sample.bytes
        return ends

    def summary(self) -> str:
        """One line: backend, device, peak and end in MiB (and reserve on CUDA)."""
        text = (f"[{self.backend} on {self.device}] peak {self.peak_mib:,.2f} MiB above baseline, "
                f"{self.end_mib:,.2f} MiB left at the end")
        if self.reserved_peak_bytes is not None:
            text += f", reserved peak {to_mib(self.reserved_peak_bytes):,.2f} MiB"
        return text


class _Recorder:
    """Shared by both backends: keeps the running total and writes timeline samples."""

    def __init__(self, measurement: MemoryMeasurement) -> None:
        self.measurement = measurement
        self.lock = threading.RLock()  # backward on CUDA runs in another thread; frees come from GC
        self.current = 0
        self.peak = 0

    def sample(self, current: int) -> None:
        with self.lock:
            self.current = current
            self.peak = max(self.peak, current)
            timeline = self.measurement.timeline
            timeline.append(MemorySample(len(timeline), self.measurement._phase, current))


def _tensors_in(obj: Any) -> Iterator[torch.Tensor]:
    """Every tensor in an aten op's arguments or result: tensors, nested in tuples, lists and dicts.

    What ``torch.utils._pytree.tree_flatten`` finds in them, without building its tree spec, which cost more than
    the rest of the tracker's work per op (an aten op's arguments hold no other container).
    """
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, (tuple, list)):
        for item in obj:
            if isinstance(item, torch.Tensor):
                yield item
            elif isinstance(item, (tuple, list, dict)):
                yield from _tensors_in(item)
    elif isinstance(obj, dict):
        for item in obj.values():
            yield from _tensors_in(item)


def _unwrap_subclasses(objects: Any) -> Iterator[Any]:
    """The objects, with each tensor subclass that wraps tensors (DTensor) replaced by its inner tensors."""
    for obj in objects:
        if isinstance(obj, torch.Tensor) and is_traceable_wrapper_subclass(obj):
            names, _ = obj.__tensor_flatten__()
            yield from _unwrap_subclasses(getattr(obj, name) for name in names)
        else:
            yield obj


class _StorageTrackerMode(TorchDispatchMode):
    """Follows every storage an aten op returns on one device type; frees arrive via weakref.

    Tensor subclasses that wrap other tensors (DTensor, ...) are followed through the inner tensors
    they hold (a DTensor by its local shard): the wrapper's own storage holds no data, and its size
    is the *logical* tensor's, so counting it would count a full model per sharded tensor.
    With ``watch_resizes`` every followed storage's size is re-read before each op, so that a
    storage shrunk or regrown outside the dispatcher (``untyped_storage().resize_``, how FSDP2
    frees and re-allocates all-gathered parameters) shows up at the next op.
    """

    def __init__(self, recorder: _Recorder, device_type: str, watch_resizes: bool = False,
                 budget_bytes: int | None = None) -> None:
        super().__init__()
        self.recorder = recorder
        self.budget_bytes = budget_bytes  # total followed bytes (baseline included) allowed, or None
        self.baseline = 0
        self.device_type = device_type
        self.live: dict[int, int] = {}  # storage id -> bytes
        self.finalizers: list[weakref.finalize] = []
        self.active = True
        self.watch_resizes = watch_resizes
        self.storages: dict[int, weakref.ref] = {}  # storage id -> the storage, with watch_resizes

    def reconcile(self) -> None:
        """Re-read the size of every followed storage (resizes done outside the dispatcher)."""
        with self.recorder.lock:
            for key, ref in list(self.storages.items()):
                storage = ref()
                if storage is None or key not in self.live:
                    self.storages.pop(key, None)
                    continue
                nbytes = storage.nbytes()
                if nbytes != self.live[key]:
                    self.recorder.sample(self.recorder.current + nbytes - self.live[key])
                    self.live[key] = nbytes

    def _watch(self, key: int, storage: torch.UntypedStorage) -> None:
        if self.watch_resizes:
            self.storages[key] = weakref.ref(storage)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
        kwargs = kwargs or {}
        if self.watch_resizes:
            self.reconcile()
        out = func(*args, **kwargs)
        input_storages = None         # read only for an output the tracker does not follow yet (most ops have none)
        for tensor in _unwrap_subclasses(_tensors_in(out)):
            if not self._follows(tensor):
                continue
            storage = tensor.untyped_storage()
            key = storage._cdata
            nbytes = storage.nbytes()
            with self.recorder.lock:
                if key in self.live:
                    if self.live[key] != nbytes:  # a storage resized in place (out= ops)
                        self.recorder.sample(self.recorder.current + nbytes - self.live[key])
                        self.live[key] = nbytes
                    continue
                if nbytes == 0:
                    continue
                if input_storages is None:
                    input_storages = {t.untyped_storage()._cdata
                                      for t in _unwrap_subclasses(_tensors_in((args, kwargs))) if self._follows(t)}
                fresh = func is torch.ops.aten.lift_fresh.default  # torch.tensor(data) arrives so
                if key in input_storages and not fresh:
                    continue  # a view or an in-place result of something that existed already
                if self.budget_bytes is not None and self.baseline + self.recorder.current + nbytes > self.budget_bytes:
                    # the new storage is not followed; it dies when the exception unwinds the op's caller
                    raise torch.OutOfMemoryError(
                        f"memory budget exceeded (tracker): {func} asked for {nbytes:,} bytes with "
                        f"{self.baseline + self.recorder.current:,} of the {self.budget_bytes:,}-byte budget in use")
                self.live[key] = nbytes
                self.finalizers.append(weakref.finalize(storage, self._free, key))
                self._watch(key, storage)
                self.recorder.sample(self.recorder.current + nbytes)
        return out

    def follow_existing(self, tensors: Iterator[torch.Tensor]) -> int:
        """Follow storages that exist already (without a sample); returns their bytes."""
        total = 0
        for tensor in _unwrap_subclasses(tensors):
            if not self._follows(tensor):
                continue
            storage = tensor.untyped_storage()
            if storage._cdata in self.live:
                continue
            self.live[storage._cdata] = storage.nbytes()
            total += storage.nbytes()
            self.finalizers.append(weakref.finalize(storage, self._free, storage._cdata))
            self._watch(storage._cdata, storage)
        return total

    def _follows(self, obj: Any) -> bool:
        return (isinstance(obj, torch.Tensor) and obj.device.type == self.device_type
                and obj.layout == torch.strided and not is_traceable_wrapper_subclass(obj))

    def _free(self, key: int) -> None:
        with self.recorder.lock:
            if not self.active or key not in self.live:
                return
            nbytes = self.live.pop(key)
            self.recorder.sample(self.recorder.current - nbytes)

    def stop(self) -> None:
        if self.watch_resizes:
            self.reconcile()
        self.active = False
        for finalizer in self.finalizers:
            finalizer.detach()


class _AllocatorSamplerMode(TorchDispatchMode):
    """Samples the CUDA caching allocator after every aten op, for the timeline."""

    def __init__(self, recorder: _Recorder, device: torch.device, baseline: int) -> None:
        super().__init__()
        self.recorder = recorder
        self.device = device
        self.baseline = baseline

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
        out = func(*args, **(kwargs or {}))
        self.recorder.sample(torch.cuda.memory_allocated(self.device) - self.baseline)
        return out


class measure_memory:  # noqa: N801 - used as a context manager, reads like a function
    """Measure the memory a region of code allocates, on CUDA or on the CPU, with one API.

    Args:
        device: the device whose memory to measure ("cpu", "cuda", a ``torch.device``).
        backend: ``"auto"`` (allocator on CUDA, tracker on CPU), ``"cuda-allocator"`` or
            ``"tracker"`` (exact storage tracking, also on CUDA to compare with the allocator).
        phase: the label of the first phase; call ``mem.phase("backward")`` to start the next.
        timeline: keep a sample per event (turn off for long loops where only the peak matters).
        include: tensors that exist before the region and should be followed by the tracker (a
            tensor, module, optimizer, or lists of them): they form its baseline, and freeing one
            inside the region (``optimizer.zero_grad()``) shows as a fall below it. The CUDA
            allocator sees everything anyway and ignores this.
        watch_resizes: tracker only (default False): re-read every followed storage's size before
            each op and at the end, to see storages resized outside the dispatcher
            (``untyped_storage().resize_(0)``, how FSDP2 frees all-gathered parameters; notebook
            11). Costs time proportional to the live storages on every op.
        budget_bytes: a memory budget in bytes (default None: none), so that code can run out of
            memory on purpose (notebook 17's batch-size search). With the tracker, an op whose
            new storage would take the followed bytes (the ``include`` baseline plus what the
            region allocated) past it raises ``torch.OutOfMemoryError``, like a GPU would. With
            the CUDA allocator the region starts with ``torch.cuda.empty_cache()`` (cached free
            blocks are reused without any check against the budget) and runs under
            ``torch.cuda.set_per_process_memory_fraction(budget / total)``, reset to 1.0 afterwards;
            the allocator then raises the same error when a new segment would take its *reserved*
            bytes (everything the process holds on the device, its cache and 512-byte rounding
            included) past the budget. So on CUDA the budget counts reserved bytes of the whole
            process, on the CPU the followed tensors' exact bytes.

    Yields:
        A ``MemoryMeasurement``; its ``peak_bytes``, ``end_bytes`` and timeline are filled in when
        the block ends.

    Raises:
        ValueError: on entry, with the CUDA allocator, a budget larger than the card (the fraction
            cannot pass 1.0, so the budget could not be what limits the region).
        torch.OutOfMemoryError: on entry, with the CUDA allocator, when the memory the process
            holds after emptying the cache already exceeds the budget; inside the region, when the
            budget runs out.

    Example:
        >>> with measure_memory("cpu", phase="forward") as mem:
        ...     loss = model(x).sum()
        ...     mem.phase("backward")
        ...     loss.backward()
        >>> mem.peak_bytes, mem.end_bytes   # end_bytes == the gradients' bytes

    Known limitations:
        * The tracker counts tensor storage only: not the CUDA context, not allocator rounding or
          fragmentation, not scratch memory a kernel allocates internally (oneDNN, cuBLAS
          workspaces). On CUDA the allocator backend includes rounding to 512-byte blocks.
        * Tensor subclasses that wrap other tensors (DTensor) are counted by their inner tensors.
          A storage resized outside the dispatcher is only seen with ``watch_resizes=True``, and
          then at the next op (a free and a re-allocation between two ops are not seen).
        * The tracker cannot see what was allocated before the region: its baseline is the bytes
          of ``include`` (0 without it), and only tensors in ``include`` are subtracted when they
          are freed inside the region.
        * Code compiled with ``torch.compile`` runs its kernels below the dispatcher; measure it
          with the CUDA allocator.
        * Measuring slows every op a little; time code outside a measured region.
    """

    def __init__(self, device: torch.device | str, *, backend: str = "auto", phase: str = "region",
                 timeline: bool = True, include: Any = None, watch_resizes: bool = False,
                 budget_bytes: int | None = None) -> None:
        if not isinstance(device, (str, torch.device)):
            raise TypeError(f"device must be a string or torch.device, not {type(device).__name__}")
        self.device = torch.device(device)
        if backend not in BACKENDS:
            raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
        if backend == "auto":
            backend = "cuda-allocator" if self.device.type == "cuda" else "tracker"
        if backend == "cuda-allocator" and self.device.type != "cuda":
            raise ValueError(f"the cuda-allocator backend needs a CUDA device, got {str(self.device)!r}")
        self.backend = backend
        self.keep_timeline = timeline
        if not isinstance(watch_resizes, bool):
            raise TypeError(f"watch_resizes must be a bool, not {type(watch_resizes).__name__}")
        self.watch_resizes = watch_resizes
        if budget_bytes is not None and (isinstance(budget_bytes, bool) or not isinstance(budget_bytes, int)
                                         or budget_bytes <= 0):
            raise ValueError(f"budget_bytes must be a positive int (bytes) or None, got {budget_bytes!r}")
        self.budget_bytes = budget_bytes
        for _ in _iter_tensors(include):  # fail early on a wrong type, but keep no reference to
            pass                           # the tensors: holding one would keep them from being freed
        self._include = include
        self.measurement = MemoryMeasurement(device=device_name(self.device), backend=backend)
        self.measurement.phase(phase)
        self._mode: TorchDispatchMode | None = None

    def __enter__(self) -> MemoryMeasurement:
        recorder = _Recorder(self.measurement)
        self._recorder = recorder
        if self.backend == "cuda-allocator":
            torch.cuda.synchronize(self.device)
            if self.budget_bytes is not None:
                self._set_cuda_budget(self.budget_bytes)
            torch.cuda.reset_peak_memory_stats(self.device)
            self._baseline = torch.cuda.memory_allocated(self.device)
            self.measurement.baseline_bytes = self._baseline
            self._include = None   # the allocator counts them already; a reference here would keep them alive
            if self.keep_timeline:
                self._mode = _AllocatorSamplerMode(recorder, self.device, self._baseline)
                baseline, device = self._baseline, self.device
                self.measurement._sample_now = lambda: recorder.sample(torch.cuda.memory_allocated(device) - baseline)
        else:
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
            self._mode = _StorageTrackerMode(recorder, self.device.type, self.watch_resizes, self.budget_bytes)
            self.measurement.baseline_bytes = self._mode.follow_existing(_iter_tensors(self._include))
            self._mode.baseline = self.measurement.baseline_bytes
            self._include = None
        recorder.sample(0)
        if self._mode is not None:
            self._mode.__enter__()
        return self.measurement

    def __exit__(self, *exc_info: object) -> None:
        if self._mode is not None:
            self._mode.__exit__(*exc_info)
        measurement = self.measurement
        measurement._sample_now = None
        if self.backend == "cuda-allocator":
            torch.cuda.synchronize(self.device)
            if self.budget_bytes is not None:
                torch.cuda.set_per_process_memory_fraction(1.0, _cuda_index(self.device))
            end = torch.cuda.memory_allocated(self.device) - self._baseline
            self._recorder.sample(end)
            measurement.peak_bytes = torch.cuda.max_memory_allocated(self.device) - self._baseline
            measurement.reserved_peak_bytes = torch.cuda.max_memory_reserved(self.device)
            measurement.end_bytes = end
        else:
            assert isinstance(self._mode, _StorageTrackerMode)
            self._mode.stop()
            measurement.peak_bytes = self._recorder.peak
            measurement.end_bytes = self._recorder.current
        if not self.keep_timeline:
            measurement.timeline = measurement.timeline[:1] + measurement.timeline[-1:]
        measurement._finished = True

    def _set_cuda_budget(self, budget: int) -> None:
        """Limit the process to ``budget`` reserved bytes of the device, from an empty cache; say why if it cannot."""
        total = torch.cuda.get_device_properties(self.device).total_memory
        if budget > total:
            raise ValueError(
                f"budget_bytes={budget:,} ({to_mib(budget):,.0f} MiB) is more than {self.measurement.device} has "
                f"({total:,} bytes, {to_mib(total):,.0f} MiB): the allocator's fraction stops at 1.0, so the card, "
                f"not the budget, would limit the region. Choose a budget below the card's memory "
                f"(utils.by_memory picks one per memory class).")
        torch.cuda.empty_cache()   # free cached blocks would be reused without any check against the fraction
        reserved = torch.cuda.memory_reserved(self.device)
        if reserved > budget:
            raise torch.OutOfMemoryError(
                f"memory budget exceeded before the region started (cuda-allocator): after empty_cache() the process "
                f"still reserves {reserved:,} bytes for tensors alive now, over the budget of {budget:,} bytes")
        # an index, not torch.device("cuda"): set_per_process_memory_fraction refuses a device without one
        torch.cuda.set_per_process_memory_fraction(budget / total, _cuda_index(self.device))


def _cuda_index(device: torch.device) -> int:
    """The CUDA device's index (the current device for a bare ``torch.device("cuda")``)."""
    return device.index if device.index is not None else torch.cuda.current_device()


@dataclass
class SavedTensors:
    """What autograd saved for backward inside a ``track_saved_tensors`` block.

    Attributes:
        bytes: bytes of the distinct storages saved (a storage saved twice counts once).
        count: number of distinct storages.
    """

    bytes: int = 0
    count: int = 0

    @property
    def mib(self) -> float:
        """``bytes`` in MiB."""
        return to_mib(self.bytes)


class track_saved_tensors:  # noqa: N801 - used as a context manager, reads like a function
    """Count the bytes autograd saves for backward (the "activations"), eager or compiled.

    It uses ``torch.autograd.graph.saved_tensors_hooks``, which sees every tensor an operation
    saves with ``save_for_backward``, including the tensors a ``torch.compile``'d graph saves for
    its backward, where the memory tracker cannot look inside. Introduced in notebook 05.

    Args:
        exclude: tensors not to count (typically the model, whose weights Linear layers save):
            a tensor, module, optimizer or lists of them, as ``tensor_bytes`` accepts.

    Example:
        >>> with track_saved_tensors(exclude=model) as saved:
        ...     loss = model(x).sum()
        >>> saved.bytes

    Known limitations:
        Tensors kept alive by other means (a Python reference, a module's cache) are not counted;
        use ``measure_memory`` for everything that is allocated.
    """

    def __init__(self, exclude: Any = None) -> None:
        self._excluded = {t.untyped_storage()._cdata for t in _iter_tensors(exclude)}
        self.result = SavedTensors()
        self._seen: dict[int, int] = {}

    def _pack(self, tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()
        if storage._cdata not in self._excluded and storage._cdata not in self._seen:
            self._seen[storage._cdata] = storage.nbytes()
            self.result.bytes += storage.nbytes()
            self.result.count += 1
        return tensor

    def __enter__(self) -> SavedTensors:
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda tensor: tensor)
        self._hooks.__enter__()
        return self.result

    def __exit__(self, *exc_info: object) -> None:
        self._hooks.__exit__(*exc_info)
