"""Full training state: capture and restore every RNG, save atomically, load safely, plan save intervals.

Introduced in notebook 12. A resumed run is only *the same run* when the checkpoint holds everything
the next step depends on: model, optimizer (its moments and its own step counter), learning-rate
scheduler, GradScaler, the step and epoch, every random generator (Python, NumPy, torch CPU, CUDA)
and the position in the data order. This module captures and restores all of it with plain
containers, so that ``torch.load(weights_only=True)`` (the safe loader, the default since torch 2.6)
accepts the file; it writes checkpoints atomically (a temporary file in the same folder, flushed,
fsynced, ``os.replace``d, then the folder fsynced), so a process killed mid-write never leaves a
truncated checkpoint behind; and it loads with clear errors for a missing, truncated or foreign file.

It also holds the small arithmetic of *how often* to save: Young's and Daly's interval and a
simulation of preemptions that checks it.
"""

from __future__ import annotations

import io
import math
import os
import pickle
import random
import signal
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, Iterable, Mapping

import torch

try:  # NumPy is optional: its generator is captured only where it is installed
    import numpy as np
except ImportError:  # pragma: no cover - numpy is installed with the course
    np = None

CHECKPOINT_FORMAT = "pytorch-intro/training-state/1"
_RNG_KEYS = ("python", "numpy", "torch", "cuda")


class CheckpointError(ValueError):
    """A checkpoint file that cannot be used: truncated, not a torch file, or not a training state."""


# --- random generators ------------------------------------------------------------------------

def capture_rng_state() -> dict[str, Any]:
    """The state of every random generator a training step may draw from, as plain containers.

    Why: dropout masks, data augmentation and shuffling draw from these generators; a resumed run
    that does not restore them draws different numbers from the step it resumes at.

    Returns:
        ``{"python": ..., "numpy": ... or None, "torch": ByteTensor, "cuda": [ByteTensor, ...] or None}``.
        Python's state is a tuple of ints, NumPy's key array becomes an int64 tensor, so the
        whole thing loads with ``torch.load(weights_only=True)``.

    Example:
        >>> rng = capture_rng_state(); a = torch.rand(1); restore_rng_state(rng); b = torch.rand(1)
        >>> bool(a == b)
        True
    """
    numpy_state = None
    if np is not None:
        legacy = np.random.get_state(legacy=False)  # the global np.random generator (MT19937)
        numpy_state = {"bit_generator": legacy["bit_generator"],
                       "key": torch.from_numpy(legacy["state"]["key"].astype(np.int64)),
                       "pos": int(legacy["state"]["pos"]), "has_gauss": int(legacy["has_gauss"]),
                       "gauss": float(legacy["gauss"])}
    cuda_state = None
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        cuda_state = torch.cuda.get_rng_state_all()  # one ByteTensor per visible GPU
    return {"python": random.getstate(), "numpy": numpy_state, "torch": torch.get_rng_state(), "cuda": cuda_state}


def restore_rng_state(state: Mapping[str, Any]) -> None:
    """Put every random generator back where ``capture_rng_state`` found it.

    Args:
        state: what ``capture_rng_state`` returned (possibly after a save and a load).

    Raises:
        TypeError: ``state`` is not a mapping.
        ValueError: keys are missing, or the CUDA state was captured on a machine with a different
            number of GPUs (restoring half of them would silently differ).
    """
    if not isinstance(state, Mapping):
        raise TypeError(f"expected the dict capture_rng_state() returned, not {type(state).__name__}")
    missing = [key for key in _RNG_KEYS if key not in state]
    if missing:
        raise ValueError(f"RNG state lacks {missing}; expected the keys {list(_RNG_KEYS)}")
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))  # a load may turn the inner tuple into a list
    if state["numpy"] is not None and np is not None:
        numpy_state = state["numpy"]
        np.random.set_state({"bit_generator": numpy_state["bit_generator"],
                             "state": {"key": numpy_state["key"].numpy().astype(np.uint32), "pos": numpy_state["pos"]},
                             "has_gauss": numpy_state["has_gauss"], "gauss": numpy_state["gauss"]})
    torch.set_rng_state(state["torch"].cpu())
    if state["cuda"] is not None and torch.cuda.is_available():
        if len(state["cuda"]) != torch.cuda.device_count():
            raise ValueError(f"the checkpoint holds the RNG state of {len(state['cuda'])} GPUs, "
                             f"this machine has {torch.cuda.device_count()}")
        torch.cuda.set_rng_state_all([s.cpu() for s in state["cuda"]])


# --- the whole training state -----------------------------------------------------------------

def capture_training_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer, *, step: int,
                           scheduler: Any = None, scaler: Any = None, epoch: int = 0,
                           data: Mapping[str, Any] | None = None, extra: Mapping[str, Any] | None = None,
                           rng: bool = True) -> dict[str, Any]:
    """Everything the next training step depends on, as one dict of plain containers and tensors.

    Why: BEE-30091's checkpoint saves model, optimizer, scheduler and step, and forgets the
    GradScaler, the RNGs and the data position; notebook 12 measures what each omission breaks.
    The tensors are *references* to the live ones (``state_dict`` does not copy): save the dict
    before the next step, or copy it with ``copy_to_cpu``.

    Args:
        model, optimizer: the model and its optimizer.
        step: optimizer steps taken so far (the next step to run is ``step``, counted from 0).
        scheduler: a learning-rate scheduler (anything with ``state_dict``), or None.
        scaler: a ``torch.amp.GradScaler``, or None.
        epoch: epochs completed so far.
        data: where the data order stands, e.g. ``{"seed": 0, "epoch": 3, "batch": 17}``.
        extra: anything else made of plain containers (a config dict, the best loss so far).
        rng: include every RNG's state (``capture_rng_state``).

    Returns:
        ``{"format": CHECKPOINT_FORMAT, "model", "optimizer", "scheduler", "scaler", "step", "epoch",
        "data", "rng", "extra"}``.

    Example:
        >>> state = capture_training_state(model, optimizer, step=100, scheduler=scheduler)
        >>> save_checkpoint(state, "build/run/latest.pt")
    """
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"model must be an nn.Module, not {type(model).__name__}")
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"optimizer must be a torch.optim.Optimizer, not {type(optimizer).__name__}")
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise ValueError(f"step must be a non-negative int, got {step!r}")
    return {
        "format": CHECKPOINT_FORMAT,
        "model": model.state_dict(),
        "optimizer": optimizer.state_dict(),
        "scheduler": scheduler.state_dict() if scheduler is not None else None,
        "scaler": scaler.state_dict() if scaler is not None else None,
        "step": step,
        "epoch": epoch,
        "data": dict(data) if data is not None else None,
        "rng": capture_rng_state() if rng else None,
        "extra": dict(extra) if extra is not None else None,
    }


def restore_training_state(state: Mapping[str, Any], model: torch.nn.Module, optimizer: torch.optim.Optimizer, *,
                           scheduler: Any = None, scaler: Any = None, rng: bool = True) -> dict[str, Any]:
    """Load a ``capture_training_state`` dict into live objects (in place) and return the counters.

    Args:
        state: the checkpoint (from ``load_checkpoint``).
        model, optimizer, scheduler, scaler: freshly built objects of the same shapes.
        rng: restore every RNG too.

    Returns:
        ``{"step", "epoch", "data", "extra"}`` from the checkpoint.

    Known limitations: ``optimizer.load_state_dict`` keeps the loaded tensors *by reference* when
    they are already on the right device and dtype, so training on changes ``state`` in place; load
    a fresh copy (or ``copy.deepcopy(state)``) to resume twice from the same dict.

    Raises:
        CheckpointError: ``state`` is not a training state, or lacks a part that was asked for
            (a scheduler passed in but none saved, say): a resume that silently skips a part is
            the bug this module exists to prevent.
    """
    _check_training_state(state, "the state")
    model.load_state_dict(state["model"])
    optimizer.load_state_dict(state["optimizer"])
    for name, target in (("scheduler", scheduler), ("scaler", scaler)):
        if target is None:
            continue
        if state[name] is None:
            raise CheckpointError(f"a {name} was passed in but the checkpoint holds none")
        target.load_state_dict(state[name])
    if rng:
        if state["rng"] is None:
            raise CheckpointError("rng=True but the checkpoint holds no RNG state")
        restore_rng_state(state["rng"])
    return {"step": state["step"], "epoch": state["epoch"], "data": state["data"], "extra": state["extra"]}


def _check_training_state(state: Any, where: str) -> None:
    if not isinstance(state, Mapping) or state.get("format") != CHECKPOINT_FORMAT:
        found = state.get("format") if isinstance(state, Mapping) else type(state).__name__
        raise CheckpointError(f"{where} is not a training checkpoint: expected format {CHECKPOINT_FORMAT!r}, "
                              f"found {found!r} (was it written by capture_training_state?)")


# --- writing and reading files ------------------------------------------------------------------

def _fsync_directory(directory: Path) -> None:
    """Persist a rename: on POSIX the directory entry lives in the directory's own blocks."""
    if os.name != "posix":  # Windows cannot open a directory; its rename is journaled by NTFS
        return
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def save_checkpoint(state: Any, path: str | os.PathLike, *, atomic: bool = True) -> Path:
    """Save ``state`` with ``torch.save``, atomically by default.

    Why: ``torch.save(state, path)`` opens ``path`` for writing, which empties it first; a process
    killed while it writes (a spot preemption, an OOM kill) leaves a truncated file where the last
    good checkpoint was. The atomic path writes a temporary file *in the same folder* (a rename
    across file systems is a copy, not atomic), closes it (flushing every buffer), ``os.fsync``s the data to
    the disk, ``os.replace``s it over ``path`` (atomic on POSIX and Windows), and fsyncs the folder
    so the rename itself survives a power cut. At any moment ``path`` holds the old or the new
    checkpoint, whole.

    Args:
        state: what to save (a ``capture_training_state`` dict, typically).
        path: the checkpoint file; its folder is created if needed.
        atomic: False writes in place, only to show what goes wrong.

    Returns:
        The path written.

    Known limitations: a killed atomic writer leaves its temporary file (``.<name>.*.tmp``) behind;
    the next successful save does not remove it. Object storage (S3, GCS) has no rename: there,
    upload the finished local file under a new key and then update a small "latest" pointer.

    Example:
        >>> save_checkpoint(capture_training_state(model, optimizer, step=10), "build/run/latest.pt")
    """
    path = Path(path)
    if path.exists() and path.is_dir():
        raise ValueError(f"{path} is a folder; give the checkpoint's file name")
    path.parent.mkdir(parents=True, exist_ok=True)
    if not atomic:
        torch.save(state, path)
        return path
    fd, temporary = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.close(fd)
    try:
        torch.save(state, temporary)    # by name: torch's own writer, which closes (flushes) the file
        fd = os.open(temporary, os.O_WRONLY)
        try:
            os.fsync(fd)                # the operating system's cache -> the disk
        finally:
            os.close(fd)
        os.replace(temporary, path)     # atomic: readers see the old file or the new one
    except BaseException:
        if os.path.exists(temporary):
            os.unlink(temporary)
        raise
    _fsync_directory(path.parent)
    return path


def load_checkpoint(path: str | os.PathLike, *, map_location: Any = "cpu", training_state: bool = True) -> Any:
    """Load a checkpoint with ``torch.load(weights_only=True)`` and clear errors.

    Why: ``torch.load`` reports a truncated file as ``OSError: [Errno 22] Invalid argument`` and a
    text file as ``KeyError: 101``; a loader that wraps that in ``except Exception: return 0``
    (BEE-30091's) silently restarts training from step 0. This one says what is wrong.

    Args:
        path: the file.
        map_location: where tensors go (``"cpu"`` by default: restore onto the device with
            ``load_state_dict`` afterwards, which copies into the live parameters).
        training_state: also check that the file is a ``capture_training_state`` dict.

    Returns:
        What was saved.

    Example:
        >>> state = load_checkpoint("build/run/latest.pt")
        >>> counters = restore_training_state(state, model, optimizer, scheduler=scheduler)

    Raises:
        FileNotFoundError: no such file.
        CheckpointError: the file is empty or truncated, not a torch checkpoint, refused by the
            safe unpickler (it holds a class or function not on the allowlist), or not a
            training state.
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"no checkpoint at {path}" + (" (it is a folder)" if path.is_dir() else ""))
    size = path.stat().st_size
    try:
        state = torch.load(path, map_location=map_location, weights_only=True)
    except pickle.UnpicklingError as error:
        refused = next((line.strip() for line in str(error).splitlines() if "Unsupported global" in line), None)
        if refused is None:  # not an allowlist refusal: garbage the unpickler could not read
            raise CheckpointError(f"{path} ({size:,} bytes) is not a readable torch checkpoint: truncated or corrupt, "
                                  f"or not written by torch.save ({str(error).splitlines()[-1][:200]})") from error
        raise CheckpointError(
            f"{path} was refused by torch.load(weights_only=True): it holds a pickled object that is not "
            f"on the allowlist ({refused}). If you wrote the file and trust it, allowlist that class with "
            f"torch.serialization.add_safe_globals([...]); never load an untrusted file with weights_only=False."
        ) from error
    except (RuntimeError, OSError, EOFError, KeyError, ValueError, IndexError) as error:
        raise CheckpointError(
            f"{path} ({size:,} bytes) is not a readable torch checkpoint: truncated or corrupt "
            f"(was the writer killed mid-save?) or not written by torch.save. torch said: "
            f"{type(error).__name__}: {error}"
        ) from error
    if training_state:
        _check_training_state(state, str(path))
    return state


def copy_to_cpu(obj: Any) -> Any:
    """A deep copy of nested dicts/lists/tuples whose tensors are cloned into CPU memory.

    Why: ``capture_training_state`` returns references to the live tensors, which the next step
    updates in place; a snapshot kept in memory (the best model so far, a state handed to another
    thread or process) must be a copy (on a GPU: device to host).

    Args:
        obj: a tensor, or nested dicts, lists and tuples of tensors and plain values.

    Returns:
        The same structure with every tensor detached and copied to the CPU; other values as they are.

    Example:
        >>> best = copy_to_cpu(capture_training_state(model, optimizer, step=step))
    """
    if isinstance(obj, torch.Tensor):
        return obj.detach().to("cpu", copy=True)
    if isinstance(obj, dict):
        return {key: copy_to_cpu(value) for key, value in obj.items()}
    if isinstance(obj, list):
        return [copy_to_cpu(value) for value in obj]
    if isinstance(obj, tuple):
        return tuple(copy_to_cpu(value) for value in obj)
    return obj


class AsyncCheckpointWriter:
    """Serialize the state into CPU memory now, write the bytes to disk (atomically) in a background thread.

    Why: a synchronous save stalls training for the whole write and fsync. Here the training
    thread only serializes the state into an in-memory buffer (about one memory copy; on a GPU it
    includes the device-to-host copy), which must happen before the next step changes the tensors
    in place; a thread then writes the bytes and fsyncs them. Those are system calls that release
    Python's GIL, so the training thread runs on (a thread running ``torch.save`` itself would
    compete for the GIL for the whole save, pickling included). One write is in flight
    at a time: a new ``save`` first waits for the previous one.
    ``torch.distributed.checkpoint.async_save`` does the same for sharded, distributed checkpoints.

    Args:
        atomic: write through a temporary file, fsync and ``os.replace`` (as ``save_checkpoint``).

    Example:
        >>> writer = AsyncCheckpointWriter()
        >>> stall_s = writer.save(capture_training_state(model, optimizer, step=step), path)
        >>> ...  # keep training
        >>> writer.wait()   # before exiting, and before trusting the file

    Known limitations: the buffer holds a second copy of the checkpoint in CPU memory until the
    write ends, and the write competes with training for the disk and memory bandwidth.
    """

    def __init__(self, *, atomic: bool = True) -> None:
        self.atomic = atomic
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self.last_write_s = float("nan")

    def save(self, state: Any, path: str | os.PathLike) -> float:
        """Serialize ``state`` to memory, start writing it, and return the seconds the caller was stalled."""
        started = time.perf_counter()
        self.wait()
        path = Path(path)
        if path.exists() and path.is_dir():
            raise ValueError(f"{path} is a folder; give the checkpoint's file name")
        buffer = io.BytesIO()
        torch.save(state, buffer)   # a snapshot: later in-place updates of the tensors do not reach it
        self._thread = threading.Thread(target=self._write, args=(buffer, path), daemon=True)
        self._thread.start()
        return time.perf_counter() - started

    def _write(self, buffer: io.BytesIO, path: Path) -> None:
        started = time.perf_counter()
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            if self.atomic:
                _write_bytes_atomically(buffer.getbuffer(), path)
            else:
                path.write_bytes(buffer.getbuffer())
        except BaseException as error:  # re-raised on the training thread by wait()
            self._error = error
        self.last_write_s = time.perf_counter() - started

    def wait(self) -> None:
        """Block until the write in flight is on disk; re-raise its error if it failed."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self._error is not None:
            error, self._error = self._error, None
            raise error


def _write_bytes_atomically(data: Any, path: Path) -> None:
    """``save_checkpoint``'s temporary file, fsync, rename and folder fsync, for bytes already serialized."""
    fd, temporary = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as handle:
            handle.write(data)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(temporary, path)
    except BaseException:
        if os.path.exists(temporary):
            os.unlink(temporary)
        raise
    _fsync_directory(path.parent)


class PreemptionFlag:
    """A context manager that turns SIGTERM (and any other listed signal) into a flag to check.

    Why: a spot VM gets SIGTERM and a short grace period (two minutes on the big clouds) before
    SIGKILL. Saving *inside* the signal handler would interrupt a half-done optimizer step; setting
    a flag and saving at the next step boundary gives a consistent checkpoint. The previous
    handlers are put back on exit.

    Args:
        signals: the signals to catch (default SIGTERM; add ``signal.SIGINT`` for Ctrl-C).

    Example:
        >>> with PreemptionFlag() as preempted:
        ...     for step in range(start, total):
        ...         train_step()
        ...         if preempted.requested:
        ...             save_checkpoint(capture_training_state(model, optimizer, step=step + 1), path)
        ...             break

    Known limitations: handlers run only in the main thread, between Python bytecodes; a long C++
    call (one huge kernel, a blocking read) delays them.
    """

    def __init__(self, signals: Iterable[int] = (signal.SIGTERM,)) -> None:
        self.signals = tuple(signals)
        if not self.signals:
            raise ValueError("give at least one signal to catch")
        self.requested = False
        self.signal_number: int | None = None
        self.received_at: float | None = None   # time.monotonic() when the signal came
        self._previous: dict[int, Any] = {}

    def _handle(self, signal_number: int, frame: Any) -> None:
        self.requested = True
        self.signal_number = signal_number
        self.received_at = time.monotonic()

    def __enter__(self) -> "PreemptionFlag":
        for number in self.signals:
            self._previous[number] = signal.signal(number, self._handle)
        return self

    def __exit__(self, *exc_info: object) -> None:
        for number, handler in self._previous.items():
            signal.signal(number, handler)
        self._previous.clear()


# --- how often to save --------------------------------------------------------------------------

def _positive_float(name: str, value: float) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        raise ValueError(f"{name} must be a positive number of seconds, got {value!r}")
    return float(value)


def young_daly_interval(save_cost_s: float, mtbf_s: float, *, daly: bool = False) -> float:
    """The checkpoint interval (compute time between saves) that minimises expected lost time.

    Young (1974): ``sqrt(2 * C * M)`` for save cost ``C`` and mean time between failures ``M``.
    Daly (2006) adds higher-order terms: ``sqrt(2CM) * (1 + sqrt(C / 2M) / 3 + C / 18M) - C`` for
    ``C < 2M`` (and ``M`` beyond that).

    Args:
        save_cost_s: seconds one save stalls training.
        mtbf_s: mean seconds between preemptions (an assumption about your cloud, not a measurement).
        daly: use Daly's higher-order formula.

    Returns:
        Seconds of training between two saves.

    Example:
        >>> round(young_daly_interval(2.0, 3600.0))
        120
    """
    cost, mtbf = _positive_float("save_cost_s", save_cost_s), _positive_float("mtbf_s", mtbf_s)
    young = math.sqrt(2 * cost * mtbf)
    if not daly:
        return young
    if cost >= 2 * mtbf:
        return mtbf
    return young * (1 + math.sqrt(cost / (2 * mtbf)) / 3 + cost / (18 * mtbf)) - cost


def expected_overhead(interval_s: float, save_cost_s: float, mtbf_s: float, restart_s: float = 0.0) -> float:
    """First-order expected overhead, as a fraction of the useful compute time.

    Each interval pays one save (``C / tau``); each preemption, about once per ``M`` seconds, loses
    half an interval plus its save on average and pays a restart: ``(tau + C) / 2M + R / M``.
    Minimising ``C / tau + tau / 2M`` over ``tau`` gives Young's ``sqrt(2CM)``.

    Args:
        interval_s: seconds of training between saves.
        save_cost_s, mtbf_s: as in ``young_daly_interval``.
        restart_s: seconds to restart after a preemption (new process, load the checkpoint).

    Returns:
        Expected extra wall time per unit of training time (0.01 = 1 %).

    Example:
        >>> round(expected_overhead(120.0, 2.0, 3600.0), 4)   # at Young's interval
        0.0336
    """
    tau = _positive_float("interval_s", interval_s)
    cost, mtbf = _positive_float("save_cost_s", save_cost_s), _positive_float("mtbf_s", mtbf_s)
    if isinstance(restart_s, bool) or not isinstance(restart_s, (int, float)) or restart_s < 0:
        raise ValueError(f"restart_s must be a non-negative number of seconds, got {restart_s!r}")
    return cost / tau + (tau + cost) / (2 * mtbf) + restart_s / mtbf


def simulate_preemptions(interval_s: float, save_cost_s: float, mtbf_s: float, work_s: float, *,
                         restart_s: float = 0.0, num_runs: int = 200, seed: int = 0) -> tuple[float, float]:
    """Simulate training runs interrupted by preemptions; return the mean overhead and its standard error.

    Each run needs ``work_s`` seconds of training, done as intervals of ``interval_s`` each followed
    by a save of ``save_cost_s``. Preemptions arrive as a Poisson process (exponential gaps, mean
    ``mtbf_s``; also during saves and restarts); a preemption loses everything since the last
    *completed* save, then the run restarts (``restart_s``) from that save.

    Args:
        interval_s, save_cost_s, mtbf_s, restart_s: seconds, as in ``expected_overhead``.
        work_s: seconds of training the run needs.
        num_runs: simulated runs.
        seed: seeds a private ``random.Random`` (the global generators are untouched).

    Returns:
        ``(mean, standard_error)`` of ``wall_time / work_s - 1`` over the runs.
    """
    tau = _positive_float("interval_s", interval_s)
    cost, mtbf = _positive_float("save_cost_s", save_cost_s), _positive_float("mtbf_s", mtbf_s)
    work = _positive_float("work_s", work_s)
    if isinstance(num_runs, bool) or not isinstance(num_runs, int) or num_runs < 2:
        raise ValueError(f"num_runs must be an int >= 2, got {num_runs!r}")
    if isinstance(restart_s, bool) or not isinstance(restart_s, (int, float)) or restart_s < 0:
        raise ValueError(f"restart_s must be a non-negative number of seconds, got {restart_s!r}")
    generator = random.Random(seed)
    full_segments = int(work // tau)
    last_segment = work - tau * full_segments   # a shorter final interval (0 when tau divides the work)
    overheads = []
    for _ in range(num_runs):
        wall, done, pending_restart = 0.0, 0, 0.0   # done: full intervals saved so far
        finished = False
        while not finished:
            # time until the next preemption; the run goes through restart, intervals and saves
            remaining = generator.expovariate(1.0 / mtbf)
            if remaining < pending_restart:           # preempted while restarting
                wall += remaining
                continue
            remaining -= pending_restart
            wall += pending_restart
            # whole (interval + save) pairs that fit before the preemption (arithmetic, not a loop)
            fit = min(full_segments - done, int(remaining // (tau + cost)))
            done += fit
            remaining -= fit * (tau + cost)
            wall += fit * (tau + cost)
            if done == full_segments and (last_segment <= 1e-12 or remaining >= last_segment + cost):
                wall += last_segment + cost if last_segment > 1e-12 else 0.0
                finished = True
            else:                                     # preempted inside an interval or its save: lost
                wall += remaining
                pending_restart = restart_s
        overheads.append(wall / work - 1.0)
    mean = sum(overheads) / num_runs
    variance = sum((o - mean) ** 2 for o in overheads) / (num_runs - 1)
    return mean, math.sqrt(variance / num_runs)
