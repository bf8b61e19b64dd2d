"""A fake of the ``torch.cuda`` functions that ``utils/`` calls, for tests on a machine without a GPU.

What it is for: executing every CUDA branch of ``utils/`` on a CPU, so that a wrong function name, a wrong
argument, or wrong bookkeeping (a peak read before its reset, a baseline not subtracted, a fraction left set
after an out-of-memory error, events recorded on the wrong device) fails here rather than on the first GPU a
reader lends the course. It tests bookkeeping and API names and signatures, **not numbers**: no kernel runs,
and no figure it produces says anything about a real card.

How it keeps to the real API: ``FakeCuda.install(monkeypatch)`` replaces each faked ``torch.cuda`` function
by a wrapper that first binds the call's arguments to the *real* function's signature (on the torch version
under test, 2.11 or 2.13), so a call the real function would reject raises ``TypeError`` here too, and it
refuses to fake a name that torch does not have. ``FakeCuda.calls`` logs every call, in order.

The allocator follows the rules the CUDA caching allocator documents and implements
(``c10/cuda/CUDACachingAllocator.cpp``; "CUDA semantics: memory management" in PyTorch's notes):

* every request is rounded up to a multiple of 512 bytes (``kMinBlockSize``), a 0-byte request allocates nothing;
* blocks are carved out of *segments* obtained with ``cudaMalloc``: requests of at most 1 MiB share 2 MiB
  segments (the small pool), requests below 10 MiB get a 20 MiB segment, larger ones a segment rounded up to
  2 MiB (the large pool); freed blocks stay in their segment, *reserved*, for reuse: reserved >= allocated;
* ``empty_cache()`` returns the segments that hold no allocated block;
* ``set_per_process_memory_fraction(f)`` is checked only when a new segment is needed: reserved bytes plus the
  new segment must stay within ``f * total_memory``; before giving up, the allocator releases its empty
  cached segments and tries once more; then it raises ``torch.OutOfMemoryError``. A block served from the
  cache is never checked against the fraction;
* ``max_memory_allocated`` / ``max_memory_reserved`` are the highest values since the last
  ``reset_peak_memory_stats``, which sets them to the current values.

* a large-pool block is split only when what would remain is more than 1 MiB (``kSmallSize``); otherwise the
  request gets the whole free block and ``memory_allocated`` counts all of it (a 19.5 MiB request in a fresh
  20 MiB segment allocates 20 MiB). Small-pool blocks are always split (the remainder is a multiple of 512);
* cuBLAS workspaces: the first matmul on a device allocates one (``CUBLAS_WORKSPACE_CONFIG``, else 32 MiB on
  compute capability 9.x, 10.x and 12.x and 8,519,680 bytes before), the first matmul in a backward pass a second
  one (autograd runs backward on its own thread, with its own cuBLAS handle); they stay allocated, as the real
  ones stay with their handles, until ``FakeCuda.clear_workspaces()`` (``torch._C._cuda_clearCublasWorkspaces``).

Not modelled: fragmentation inside segments (a segment serves any request that fits its free bytes),
streams other than each device's one current stream, the CUDA context, cuDNN workspaces, pinned host memory.

Tensors: ``FakeCuda.alloc(nbytes)`` returns a handle whose block is freed when the handle dies, and
``FakeCuda.mirror()`` is a dispatch mode under which every new CPU tensor storage an aten op creates is also
allocated on the fake device (and freed when the storage dies), so that real CPU code (a model's forward and
backward, an optimizer step) drives the fake allocator the way the same code would drive the real one on CUDA.
"""

from __future__ import annotations

import contextlib
import inspect
import os
import math
import weakref
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

KIB, MIB = 1024, 1024**2
MIN_BLOCK = 512                 # kMinBlockSize: every allocation is a multiple of this
SMALL_SIZE = 1 * MIB            # kSmallSize: requests up to this come from the small pool
SMALL_BUFFER = 2 * MIB          # kSmallBuffer: the small pool's segment size
MIN_LARGE_ALLOC = 10 * MIB      # kMinLargeAlloc: below this, a large request gets a kLargeBuffer segment
LARGE_BUFFER = 20 * MIB         # kLargeBuffer
ROUND_LARGE = 2 * MIB           # kRoundLarge: larger segments are rounded up to this
MATMULS = ("mm", "addmm", "bmm", "baddbmm", "addbmm", "matmul", "linear", "_addmm_activation")


def cublas_workspace_bytes(capability: tuple[int, int], config: str | None = None) -> int:
    """torch's cuBLAS workspace per handle (aten/src/ATen/cuda/CublasHandlePool.cpp, parseChosenWorkspaceSize):
    ``CUBLAS_WORKSPACE_CONFIG`` (":SIZE_KIB:COUNT" pairs) when set, else 32 MiB on Hopper and Blackwell
    (major 9, 10, 12) and ``4096 KiB * 2 + 16 KiB * 8`` on earlier cards."""
    import re
    if config:
        pairs = re.findall(r":([0-9]+):([0-9]+)", config)
        if pairs:
            return sum(int(size) * 1024 * int(count) for size, count in pairs)
    return 4096 * 8 * 1024 if capability[0] in (9, 10, 12) else 4096 * 1024 * 2 + 16 * 1024 * 8

# the torch.cuda functions the fake replaces (each must exist on the torch under test)
FAKED = (
    "is_available", "is_initialized", "device_count", "current_device", "set_device", "synchronize",
    "get_device_name", "get_device_properties", "get_device_capability",
    "memory_allocated", "max_memory_allocated", "memory_reserved", "max_memory_reserved",
    "reset_peak_memory_stats", "empty_cache", "set_per_process_memory_fraction",
    "current_stream", "get_rng_state_all", "set_rng_state_all", "get_rng_state", "set_rng_state",
    "manual_seed", "manual_seed_all",
    "is_current_stream_capturing",   # not utils': torch.optim's step asks it whenever is_available() says True
)


def round_size(nbytes: int) -> int:
    """The bytes the allocator hands out for a request of ``nbytes``: a multiple of 512 (0 stays 0)."""
    if nbytes <= 0:
        return 0
    return MIN_BLOCK * math.ceil(nbytes / MIN_BLOCK)


def segment_size(rounded: int) -> int:
    """The size of the segment ``cudaMalloc`` gets for a block of ``rounded`` bytes that fits no cached segment."""
    if rounded <= SMALL_SIZE:
        return SMALL_BUFFER
    if rounded < MIN_LARGE_ALLOC:
        return LARGE_BUFFER
    return ROUND_LARGE * math.ceil(rounded / ROUND_LARGE)


@dataclass
class FakeProperties:
    """What ``torch.cuda.get_device_properties`` returns, the fields utils/ reads."""

    name: str
    total_memory: int
    major: int
    minor: int
    multi_processor_count: int = 108


@dataclass
class Segment:
    """One ``cudaMalloc``: ``size`` bytes reserved, ``used`` of them in allocated blocks."""

    size: int
    small: bool
    used: int = 0


@dataclass
class FakeDevice:
    """One fake GPU's allocator state, RNG state and stream clock."""

    index: int
    properties: FakeProperties
    segments: list[Segment] = field(default_factory=list)
    allocated: int = 0
    peak_allocated: int = 0
    peak_reserved: int = 0
    fraction: float | None = None   # None: no fraction set (the card's memory is the limit)
    rng_state: torch.Tensor = field(default_factory=lambda: torch.zeros(16, dtype=torch.uint8))
    queued_ms: float = 0.0          # when the work launched so far will have finished on the device
    done_ms: float = 0.0            # how far the device has executed, as the host has seen by synchronising

    @property
    def reserved(self) -> int:
        return sum(segment.size for segment in self.segments)

    @property
    def limit(self) -> int:
        total = self.properties.total_memory
        return total if self.fraction is None else int(self.fraction * total)


class FakeBlock:
    """A handle on an allocated block; the block is freed when the handle is garbage (like a tensor's storage)."""

    def __init__(self, fake: "FakeCuda", device: FakeDevice, segment: Segment | None, size: int) -> None:
        self.device_index = device.index
        self.size = size
        self._free = weakref.finalize(self, fake._free, device, segment, size)

    def free(self) -> None:
        """Free the block now (what ``del tensor`` does when it held the last reference)."""
        self._free()


class FakeStream:
    """``torch.cuda.current_stream(device)``: one stream per device, named by its device."""

    def __init__(self, device_index: int) -> None:
        self.device = torch.device("cuda", device_index)
        self.device_index = device_index

    def is_capturing(self) -> bool:
        """No CUDA graph is ever being captured on a fake stream."""
        return False


class FakeCuda:
    """Fake GPUs behind the ``torch.cuda`` functions ``utils/`` calls (see the module's docstring).

    Args:
        device_count: how many GPUs (cuda:0, cuda:1, ...).
        total_memory: each card's ``total_memory`` in bytes (an int, or a list with one per card).
        capability: each card's compute capability (a tuple, or a list with one per card).
        name: the cards' name.

    Example:
        >>> fake = FakeCuda(total_memory=16 * 10**9, capability=(7, 5))
        >>> fake.install(monkeypatch)
        >>> with fake.mirror(), utils.measure_memory("cuda") as mem:
        ...     y = torch.ones(10)          # a CPU tensor, counted as a 512-byte block on fake cuda:0
    """

    def __init__(self, device_count: int = 1, total_memory: int | list[int] = 16 * 2**30,
                 capability: tuple[int, int] | list[tuple[int, int]] = (8, 0), name: str = "Fake GPU") -> None:
        totals = total_memory if isinstance(total_memory, list) else [total_memory] * device_count
        capabilities = capability if isinstance(capability, list) else [capability] * device_count
        if len(totals) != device_count or len(capabilities) != device_count:
            raise ValueError("give one total_memory and one capability per device, or one for all")
        self.devices = [FakeDevice(i, FakeProperties(f"{name} {i}", totals[i], *capabilities[i]))
                        for i in range(device_count)]
        for device in self.devices:
            device.rng_state = self._seeded_state(device.index, 0)
        self.current = 0
        self.calls: list[tuple[str, tuple, dict]] = []
        self.workspaces: dict[tuple[int, bool], FakeBlock] = {}   # (device, in backward) -> its cuBLAS workspace

    # --- installing ---------------------------------------------------------------------------------------

    def install(self, monkeypatch: Any) -> "FakeCuda":
        """Replace the ``torch.cuda`` functions in ``FAKED`` and ``torch.cuda.Event`` for one test."""
        for name in FAKED:
            real = getattr(torch.cuda, name, None)
            if real is None:
                raise AttributeError(f"torch {torch.__version__} has no torch.cuda.{name}: nothing to stand in for")
            monkeypatch.setattr(torch.cuda, name, self._checked(name, real, getattr(self, f"_{name}")))
        monkeypatch.setattr(torch.cuda, "Event", self._event_class())
        # torch >= 2.14: torch.optim's step asks torch.accelerator for the current stream once CUDA is available
        if hasattr(torch, "accelerator") and hasattr(torch.accelerator, "current_stream"):
            monkeypatch.setattr(torch.accelerator, "current_stream", lambda device=None: self._current_stream(device))
        return self

    def _checked(self, name: str, real: Callable, impl: Callable) -> Callable:
        signature = inspect.signature(real)

        def fake(*args: Any, **kwargs: Any) -> Any:
            try:
                signature.bind(*args, **kwargs)
            except TypeError as error:
                raise TypeError(f"torch.cuda.{name}{signature} (torch {torch.__version__}) would reject "
                                f"args={args!r} kwargs={kwargs!r}: {error}") from None
            self.calls.append((name, args, kwargs))
            return impl(*args, **kwargs)

        fake.__name__ = name
        fake.__signature__ = signature  # type: ignore[attr-defined]
        return fake

    def called(self, name: str) -> list[tuple[tuple, dict]]:
        """The ``(args, kwargs)`` of every call of ``torch.cuda.<name>`` so far, in order."""
        return [(args, kwargs) for called, args, kwargs in self.calls if called == name]

    # --- devices ------------------------------------------------------------------------------------------

    def device(self, device: Any = None) -> FakeDevice:
        """The fake device a ``device`` argument names, resolved the way ``torch.cuda`` resolves it."""
        if device is None:
            index = self.current
        elif isinstance(device, int) and not isinstance(device, bool):
            index = device
        elif isinstance(device, (str, torch.device)):
            device = torch.device(device)
            if device.type != "cuda":
                raise ValueError(f"Expected a cuda device, but got: {device}")
            index = self.current if device.index is None else device.index
        else:
            raise TypeError(f"a device must be None, an int, a string or a torch.device, got {type(device).__name__}")
        if not 0 <= index < len(self.devices):
            raise RuntimeError(f"CUDA error: invalid device ordinal {index} ({len(self.devices)} fake devices)")
        return self.devices[index]

    def _is_available(self) -> bool:
        return True

    def _is_initialized(self) -> bool:
        return True

    def _device_count(self) -> int:
        return len(self.devices)

    def _current_device(self) -> int:
        return self.current

    def _set_device(self, device: Any) -> None:
        self.current = self.device(device).index

    def _get_device_name(self, device: Any = None) -> str:
        return self.device(device).properties.name

    def _get_device_properties(self, device: Any = None) -> FakeProperties:
        return self.device(device).properties

    def _get_device_capability(self, device: Any = None) -> tuple[int, int]:
        properties = self.device(device).properties
        return properties.major, properties.minor

    # --- the caching allocator ----------------------------------------------------------------------------

    def alloc(self, nbytes: int, device: Any = None) -> FakeBlock:
        """Allocate ``nbytes`` on a fake device the way the caching allocator does; keep the handle alive.

        Raises:
            torch.OutOfMemoryError: a new segment would take the reserved bytes past the fraction (or the card),
                even after the empty cached segments were released.
        """
        target = self.device(device)
        size = round_size(nbytes)
        if size == 0:
            return FakeBlock(self, target, None, 0)
        small = size <= SMALL_SIZE
        segment = next((s for s in target.segments if s.small == small and s.size - s.used >= size), None)
        if segment is not None and not small and segment.size - segment.used - size <= SMALL_SIZE:
            size = segment.size - segment.used      # not split: the request gets the whole free block
        if segment is None:
            new_size = segment_size(size)
            if target.reserved + new_size > target.limit:
                self._release_cached(target)            # what the allocator does before it gives up
            if target.reserved + new_size > target.limit:
                raise torch.OutOfMemoryError(
                    f"CUDA out of memory (fake). Tried to allocate {size:,} bytes in a new {new_size:,}-byte segment; "
                    f"{target.reserved:,} bytes reserved, {target.allocated:,} allocated, limit {target.limit:,}")
            segment = Segment(new_size, small)
            target.segments.append(segment)
            if not small and new_size - size <= SMALL_SIZE:
                size = new_size                     # a remainder of 1 MiB or less is not split off

        segment.used += size
        target.allocated += size
        target.peak_allocated = max(target.peak_allocated, target.allocated)
        target.peak_reserved = max(target.peak_reserved, target.reserved)
        return FakeBlock(self, target, segment, size)

    def _free(self, device: FakeDevice, segment: Segment | None, size: int) -> None:
        if segment is None:
            return
        segment.used -= size
        device.allocated -= size

    def workspace(self, device: FakeDevice, in_backward: bool) -> None:
        """Allocate the cuBLAS workspace of this device and thread on its first matmul (kept until cleared)."""
        key = (device.index, in_backward)
        if key not in self.workspaces:
            capability = (device.properties.major, device.properties.minor)
            self.workspaces[key] = self.alloc(cublas_workspace_bytes(capability, os.environ.get("CUBLAS_WORKSPACE_CONFIG")),
                                              device.index)

    def clear_workspaces(self) -> None:
        """Free every cuBLAS workspace (what ``torch._C._cuda_clearCublasWorkspaces()`` does)."""
        for block in self.workspaces.values():
            block.free()
        self.workspaces.clear()

    @staticmethod
    def _release_cached(device: FakeDevice) -> None:
        device.segments = [segment for segment in device.segments if segment.used > 0]

    def _memory_allocated(self, device: Any = None) -> int:
        return self.device(device).allocated

    def _max_memory_allocated(self, device: Any = None) -> int:
        return self.device(device).peak_allocated

    def _memory_reserved(self, device: Any = None) -> int:
        return self.device(device).reserved

    def _max_memory_reserved(self, device: Any = None) -> int:
        return self.device(device).peak_reserved

    def _reset_peak_memory_stats(self, device: Any = None) -> None:
        target = self.device(device)
        target.peak_allocated, target.peak_reserved = target.allocated, target.reserved

    def _empty_cache(self) -> None:
        for device in self.devices:
            self._release_cached(device)

    def _set_per_process_memory_fraction(self, fraction: Any, device: Any = None) -> None:
        if not isinstance(fraction, float):         # the real function's own checks, in its order
            raise TypeError("Invalid type for fraction argument, must be `float`")
        if fraction < 0 or fraction > 1:
            raise ValueError(f"Invalid fraction value: {fraction}. Allowed range: 0~1")
        if isinstance(device, (str, torch.device)) and torch.device(device).index is None:
            # the real one wants an index (torch.cuda._utils._get_device_index without optional=True; seen on
            # torch 2.11 on an H100): torch.device("cuda") is refused
            raise ValueError(f"Expected a torch.device with a specified index or an integer, but got:{device}")
        self.device(device).fraction = fraction

    @contextlib.contextmanager
    def mirror(self, device: Any = None) -> Iterator[None]:
        """Within the block, every new CPU storage an aten op creates is also a block on the fake device.

        The block is freed when the storage dies, so CPU code drives the fake allocator as the same code
        would drive the real one on CUDA (every CPU tensor stands for a CUDA tensor, optimizer ``step``
        counters included, which real CUDA optimizers keep on the host unless capturable or fused).
        An allocation that does not fit raises ``torch.OutOfMemoryError`` from inside the op.
        """
        with _MirrorMode(self, self.device(device)):
            yield

    # --- streams, events, synchronisation -----------------------------------------------------------------

    def launch(self, milliseconds: float, device: Any = None) -> None:
        """Queue ``milliseconds`` of work on a device's current stream (what a kernel launch does)."""
        self.device(device).queued_ms += milliseconds

    def _synchronize(self, device: Any = None) -> None:
        target = self.device(device)
        target.done_ms = target.queued_ms

    def _is_current_stream_capturing(self) -> bool:
        return False

    def _current_stream(self, device: Any = None) -> FakeStream:
        return FakeStream(self.device(device).index)

    def _event_class(self) -> type:
        fake = self
        real = torch.cuda.Event

        class FakeEvent:
            """``torch.cuda.Event``: records a device's stream clock; elapsed_time needs both events complete."""

            def __init__(self, *args: Any, **kwargs: Any) -> None:
                bound = inspect.signature(real.__new__).bind(real, *args, **kwargs)
                bound.apply_defaults()
                self.enable_timing = bool(bound.arguments["enable_timing"])
                self.device_index: int | None = None
                self.at_ms: float | None = None
                fake.calls.append(("Event", args, kwargs))

            def record(self, stream: Any = None) -> None:
                inspect.signature(real.record).bind(self, stream)
                stream = fake._current_stream() if stream is None else stream
                if not isinstance(stream, FakeStream):
                    raise TypeError(f"Event.record expects a stream, got {type(stream).__name__}")
                if self.device_index is not None and self.device_index != stream.device_index:
                    raise RuntimeError("Event device does not match recording stream's device")
                self.device_index = stream.device_index
                self.at_ms = fake.devices[stream.device_index].queued_ms
                fake.calls.append(("Event.record", (stream.device_index,), {}))

            def query(self) -> bool:
                return self.at_ms is None or fake.devices[self.device_index].done_ms >= self.at_ms

            def synchronize(self) -> None:
                inspect.signature(real.synchronize).bind(self)
                if self.at_ms is not None:
                    target = fake.devices[self.device_index]
                    target.done_ms = max(target.done_ms, self.at_ms)

            def elapsed_time(self, end_event: "FakeEvent") -> float:
                inspect.signature(real.elapsed_time).bind(self, end_event)
                if not (self.enable_timing and end_event.enable_timing):
                    raise RuntimeError("Both events must be created with argument 'enable_timing=True'.")
                if self.at_ms is None or end_event.at_ms is None:
                    raise RuntimeError("Both events must be recorded before calculating elapsed time.")
                if self.device_index != end_event.device_index:
                    raise RuntimeError("CUDA error: invalid resource handle (events on different devices)")
                if not (self.query() and end_event.query()):
                    raise RuntimeError("CUDA error: device not ready (synchronize before elapsed_time)")
                return end_event.at_ms - self.at_ms

        return FakeEvent

    # --- random number generators -------------------------------------------------------------------------

    @staticmethod
    def _seeded_state(index: int, seed: int) -> torch.Tensor:
        generator = torch.Generator().manual_seed(seed * 1000 + index)
        return torch.randint(0, 256, (16,), dtype=torch.uint8, generator=generator)

    def draw(self, device: Any = None) -> int:
        """One number from a device's fake generator, advancing it (what ``torch.rand(..., device=...)`` does)."""
        target = self.device(device)
        value = int(target.rng_state[0]) * 256 + int(target.rng_state[1])
        target.rng_state = torch.roll(target.rng_state, 1) ^ torch.tensor(37, dtype=torch.uint8)
        return value

    def _get_rng_state_all(self) -> list[torch.Tensor]:
        return [device.rng_state.clone() for device in self.devices]

    def _set_rng_state_all(self, new_states: Any) -> None:
        states = list(new_states)
        for index, state in enumerate(states):
            self._set_rng_state(state, index)

    def _get_rng_state(self, device: Any = "cuda") -> torch.Tensor:
        return self.device(device).rng_state.clone()

    def _set_rng_state(self, new_state: torch.Tensor, device: Any = "cuda") -> None:
        if not isinstance(new_state, torch.Tensor) or new_state.dtype != torch.uint8 or new_state.device.type != "cpu":
            raise TypeError("RNG state must be a torch.ByteTensor on the CPU")
        self.device(device).rng_state = new_state.clone()

    def _manual_seed(self, seed: int) -> None:
        target = self.device()
        target.rng_state = self._seeded_state(target.index, int(seed))

    def _manual_seed_all(self, seed: int) -> None:
        for device in self.devices:
            device.rng_state = self._seeded_state(device.index, int(seed))


class _MirrorMode(TorchDispatchMode):
    """Allocates a fake block for every new CPU storage an op returns; frees it when the storage dies."""

    def __init__(self, fake: FakeCuda, device: FakeDevice) -> None:
        super().__init__()
        self.fake = fake
        self.device = device
        self.blocks: dict[int, FakeBlock] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
        if func.__name__.split(".")[0] in MATMULS:
            self.fake.workspace(self.device, torch._C._current_graph_task_id() != -1)
        out = func(*args, **(kwargs or {}))
        inputs = {t.untyped_storage()._cdata for t in tree_flatten((args, kwargs))[0] if self._cpu(t)}
        fresh = func is torch.ops.aten.lift_fresh.default
        for tensor in tree_flatten(out)[0]:
            if not self._cpu(tensor):
                continue
            storage = tensor.untyped_storage()
            key = storage._cdata
            if key in self.blocks or (key in inputs and not fresh) or storage.nbytes() == 0:
                continue   # a view, an in-place result, or a storage already counted
            self.blocks[key] = self.fake.alloc(storage.nbytes(), self.device.index)
            weakref.finalize(storage, self._release, key)
        return out

    @staticmethod
    def _cpu(obj: Any) -> bool:
        return isinstance(obj, torch.Tensor) and obj.device.type == "cpu" and obj.layout == torch.strided

    def _release(self, key: int) -> None:
        block = self.blocks.pop(key, None)
        if block is not None:
            block.free()


# --- running code written for a GPU: CUDA tensors made on the CPU, kernels timed by a simple model -------------
# Added for notebooks 04 and 06 (issue 42): their GPU-only branches (TF32 as a format, bf16 against TF32, the roofs
# and the overhead verdict) run in a test as they would on a card, with the times a stated device model gives.

def _cpu_device(value: Any) -> Any:
    """``"cuda"``, ``"cuda:1"`` or a CUDA ``torch.device`` -> the CPU; anything else unchanged."""
    if isinstance(value, str) and value.split(":")[0] == "cuda":
        return "cpu"
    if isinstance(value, torch.device) and value.type == "cuda":
        return torch.device("cpu")
    return value


class _OnTheFakeDevice(torch.overrides.TorchFunctionMode):
    """Code that makes CUDA tensors (``device="cuda"``, ``.to(device)``, ``.cuda()``, ``pin_memory()``) gets CPU
    tensors instead, so a GPU branch runs on a CPU-only build. The tensors say ``device.type == "cpu"``: code that
    reads the device from a tensor takes its CPU path (autocast's device type, for one), code that reads it from the
    device it was given (``time_fn(fn, DEVICE)``) takes the CUDA path, against the fake."""

    def __torch_function__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
        kwargs = {key: _cpu_device(value) if key == "device" else value for key, value in (kwargs or {}).items()}
        name = getattr(func, "__name__", "")
        if name == "cuda" or name == "pin_memory":
            return args[0]                       # already "on the device"; a CPU-only build cannot pin
        if name == "to":
            args = tuple(_cpu_device(arg) for arg in args)
        return func(*args, **kwargs)


@dataclass
class GpuModel:
    """How long a kernel takes on the simulated card: a launch cost per kernel, matmuls at a rate per format
    (fp32 at ``tf32_tflops`` while ``torch.backends.cuda.matmul.fp32_precision == "tf32"``), every other kernel at
    the memory bandwidth (the bytes of the tensors it reads and writes, each once). Views launch nothing. Round,
    H100-like defaults; no figure a test derives from them says anything about a real card."""

    launch_us: float = 5.0
    fp32_tflops: float = 50.0
    tf32_tflops: float = 400.0
    bf16_tflops: float = 800.0
    fp16_tflops: float = 800.0
    bandwidth_gbs: float = 3000.0

    def matmul_tflops(self, dtype: torch.dtype) -> float:
        if dtype == torch.float32:
            return self.tf32_tflops if torch.backends.cuda.matmul.fp32_precision == "tf32" else self.fp32_tflops
        return {torch.bfloat16: self.bf16_tflops, torch.float16: self.fp16_tflops}.get(dtype, self.fp32_tflops)


class _SimulatedKernels(TorchDispatchMode):
    """Queues each aten op's modelled time on a fake device's stream (``FakeCuda.launch``), so that ``time_fn`` on
    the fake device measures the model's time, and counts the kernels launched."""

    MATMUL_OPS = ("mm", "addmm", "bmm", "baddbmm")

    def __init__(self, fake: "FakeCuda", device: FakeDevice, model: GpuModel) -> None:
        super().__init__()
        self.fake, self.device, self.model = fake, device, model
        self.kernels = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
        out = func(*args, **(kwargs or {}))
        inputs = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
        outputs = [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)]
        in_storages = {t.untyped_storage()._cdata for t in inputs}
        if not func._schema.is_mutable and outputs and all(t.untyped_storage()._cdata in in_storages
                                                           for t in outputs):
            return out                              # a view (t, view, expand, detach): no kernel
        name = func.__name__.split(".")[0]
        if name in self.MATMUL_OPS:
            first = [t for t in inputs if t.dim() >= 2][0]
            flops = 2 * math.prod(outputs[0].shape) * first.shape[-1]
            work_ms = flops / (self.model.matmul_tflops(outputs[0].dtype) * 1e12) * 1e3
        else:
            touched = {t.untyped_storage()._cdata: t.numel() * t.element_size() for t in inputs + outputs}
            moved = sum(touched.values())           # each tensor read or written once (copy_: source and target)
            work_ms = moved / (self.model.bandwidth_gbs * 1e9) * 1e3
        self.kernels += 1
        self.fake.launch(self.model.launch_us / 1e3 + work_ms, self.device.index)
        return out


def _run_as_gpu(self: FakeCuda, model: GpuModel | None = None, device: Any = None):
    """Within the block, code written for a GPU runs on the CPU against this fake: CUDA tensors are made on the
    CPU (``_OnTheFakeDevice``) and every kernel queues the time ``model`` gives it on the fake device's stream
    (``_SimulatedKernels``). Yields the kernel counter (``.kernels``).

    Example:
        >>> with fake.run_as_gpu(GpuModel(tf32_tflops=400)):
        ...     timing = utils.time_fn(lambda: a @ b, "cuda")     # the modelled matmul time, read with fake events
    """
    simulated = _SimulatedKernels(self, self.device(device), model or GpuModel())

    @contextlib.contextmanager
    def block() -> Iterator[_SimulatedKernels]:
        with _OnTheFakeDevice(), simulated:
            yield simulated

    return block()


FakeCuda.run_as_gpu = _run_as_gpu
