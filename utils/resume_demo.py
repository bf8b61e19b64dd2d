"""Fresh processes for notebook 16: run the notebook's own checkpoint recipe where nothing else is in memory.

Introduced in notebook 16. The notebook writes its recipe as plain functions (``make_data``, ``epoch_batches``,
``make_run``, ``train``, ``training_state``, ``save_atomically``, ``restore`` and
``train_until_preempted``); a resumed run proves something only in a process that shares nothing
with the run that saved, so the notebook sends the *source text* of those functions
(``inspect.getsource``) and its settings (plain values: sizes, seeds, the device) to a child, which
executes that text in a namespace of its own (``recipe_namespace``) and calls it:

- ``resume``: for each checkpoint file, build a fresh run, ``restore`` it and ``train`` to the last
  step; write the final weights and the losses (``out``).
- ``write``: save a large state again and again, in place (``torch.save`` into the opened file) or
  with the recipe's ``save_atomically``, until the notebook kills it.
- ``train``: ``train_until_preempted`` until SIGTERM arrives; report when it saved.
- ``ping``: nothing; the first child's start-up time is what a restart costs before the load.

Children are forked from a *forkserver*: one separate interpreter that imports torch (and trains
nothing), then forks a clean child per command in milliseconds. This module is the plumbing; the
technique is the notebook's.
"""

from __future__ import annotations

import itertools
import math
import multiprocessing
import os
import random
import signal
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, Callable, Mapping

import numpy as np
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

from .checks import positive_number

RECIPE_FUNCTIONS = ("make_data", "make_run", "epoch_batches", "train", "training_state", "save_atomically",
                    "restore")


def recipe_namespace(recipe: str, settings: Mapping[str, Any]) -> dict[str, Any]:
    """Execute the recipe's source text in a fresh namespace that holds the modules it uses and ``settings``.

    Args:
        recipe: Python source defining at least ``RECIPE_FUNCTIONS`` (notebook 16's cells, as text).
        settings: the module-level names the recipe reads (``DEVICE``, ``SEED``, ``BATCH_SIZE`` ...).

    Returns:
        The namespace, with ``inputs`` and ``labels`` set from the recipe's ``make_data()``.

    Raises:
        TypeError: ``recipe`` is not a string or ``settings`` not a mapping.
        ValueError: the recipe lacks one of ``RECIPE_FUNCTIONS``.
    """
    if not isinstance(recipe, str):
        raise TypeError(f"recipe must be Python source text, not {type(recipe).__name__}")
    if not isinstance(settings, Mapping):
        raise TypeError(f"settings must be a mapping of names to values, not {type(settings).__name__}")
    import utils   # the recipe builds its model with utils.MLP and its data with utils.make_classification_data

    namespace: dict[str, Any] = {"__name__": "recipe", "math": math, "os": os, "random": random, "signal": signal,
                                 "tempfile": tempfile, "time": time, "Path": Path, "torch": torch, "F": F,
                                 "nn": torch.nn, "utils": utils, "np": np, "itertools": itertools,
                                 "DataLoader": DataLoader, "TensorDataset": TensorDataset, **settings}
    exec(compile(recipe, "<notebook 16's recipe>", "exec"), namespace)
    missing = [name for name in RECIPE_FUNCTIONS if not callable(namespace.get(name))]
    if missing:
        raise ValueError(f"the recipe does not define {missing}; it needs {list(RECIPE_FUNCTIONS)}")
    namespace["inputs"], namespace["labels"] = namespace["make_data"]()
    return namespace


def flat_weights(model: torch.nn.Module) -> torch.Tensor:
    """All parameters as one float32 CPU vector, to compare two runs."""
    return torch.cat([p.detach().float().cpu().reshape(-1) for p in model.parameters()])


# --- what the child processes do ----------------------------------------------------------------
# Each command reports progress through ``report(line)``: the pipe to the notebook.

def resume_command(report: Callable[[str], None], *, recipe: str, settings: Mapping[str, Any],
                   checkpoints: Mapping[str, str], out: str) -> None:
    """Resume from each checkpoint with the recipe and train to ``settings["TOTAL_STEPS"]``; save the outcomes."""
    recipe_ns = recipe_namespace(recipe, settings)
    outcome: dict[str, Any] = {}
    for name, path in checkpoints.items():
        started = time.perf_counter()
        run = recipe_ns["make_run"]()                       # as a new process builds it, seeded
        position = recipe_ns["restore"](Path(path), *run)
        if not outcome:
            report(f"loaded step {position['step']} in {time.perf_counter() - started:.6f} s")
        losses = recipe_ns["train"](*run, position, settings["TOTAL_STEPS"] - position["step"])
        outcome[name] = {"weights": flat_weights(run[0]), "losses": torch.tensor(losses), "final_step": position["step"]}
    torch.save(outcome, out)
    report(f"resumed {len(outcome)} checkpoints, outcomes written to {out}")


def write_command(report: Callable[[str], None], *, recipe: str, settings: Mapping[str, Any], path: str, mode: str,
                  megabytes: float = 32.0) -> None:
    """Save a state of about ``megabytes`` MiB again and again (``mode`` "inplace" or "atomic"), until killed."""
    if mode not in ("inplace", "atomic"):
        raise ValueError(f"mode must be 'inplace' or 'atomic', got {mode!r}")
    positive_number("megabytes", megabytes)
    save_atomically = recipe_namespace(recipe, settings)["save_atomically"]
    side = int(math.sqrt(megabytes * 2**20 / 4))
    weight = torch.randn(side, side)
    report(f"ready {side}")
    step = 0
    while True:   # back-to-back saves, so that a kill almost surely lands inside one
        step += 1
        state = {"model": {"weight": weight}, "position": {"step": step, "epoch": 0, "batch": step}}
        started = time.perf_counter()
        if mode == "atomic":
            report(f"writing {step}")
            save_atomically(state, Path(path))
        else:
            # what torch.save(state, path) does: open (which empties the file), then write; reporting
            # between the two tells the notebook that from now until the close the file is incomplete
            with open(path, "wb") as file:
                report(f"writing {step}")
                torch.save(state, file)
        report(f"saved {step} {time.perf_counter() - started:.6f}")


def train_command(report: Callable[[str], None], *, recipe: str, settings: Mapping[str, Any], path: str) -> None:
    """Run the recipe's ``train_until_preempted`` on a fresh run; report the step saved and the times."""
    recipe_ns = recipe_namespace(recipe, settings)
    position = {"step": 0, "epoch": 0, "batch": 0}
    train, save_atomically = recipe_ns["train"], recipe_ns["save_atomically"]
    saves: list[float] = []

    def reporting_train(*args: Any, **kwargs: Any) -> list[float]:   # the recipe's train, reporting once it runs
        losses = train(*args, **kwargs)
        if position["step"] == 3:                   # the SIGTERM handler is installed by now: signal away
            report("training")
        return losses

    def timed_save(*args: Any, **kwargs: Any) -> None:
        started = time.perf_counter()
        save_atomically(*args, **kwargs)
        saves.append(time.perf_counter() - started)

    recipe_ns["train"], recipe_ns["save_atomically"] = reporting_train, timed_save
    signalled_at = recipe_ns["train_until_preempted"](Path(path), *recipe_ns["make_run"](), position)
    since_signal_s = time.monotonic() - signalled_at
    report(f"preempted step {position['step']} save_s {saves[-1]:.6f} since_signal_s {since_signal_s:.6f}")


def ping_command(report: Callable[[str], None]) -> None:
    """Answer "pong": an empty child, to time how long a fresh interpreter takes to be ready."""
    report("pong")


COMMANDS = {"resume": resume_command, "write": write_command, "train": train_command, "ping": ping_command}


# --- starting them --------------------------------------------------------------------------------

_FORKSERVER: Any = None


def _context() -> Any:
    """A forkserver: one fresh interpreter that imports torch once, then forks a clean child per Child."""
    global _FORKSERVER
    if _FORKSERVER is None:
        if "forkserver" not in multiprocessing.get_all_start_methods():
            raise RuntimeError("notebook 16's child processes need the 'forkserver' start method (Linux, macOS)")
        _FORKSERVER = multiprocessing.get_context("forkserver")
        _FORKSERVER.set_forkserver_preload(["utils.resume_demo", "torch._dynamo"])  # optimizers import it
    return _FORKSERVER


def _child_main(command: str, kwargs: dict[str, Any], threads: int, deterministic: bool,
                environment: dict[str, str], connection: Any) -> None:
    # The same thread count as the parent (a reduction split differently rounds differently), and on CUDA the
    # same deterministic kernels: cuBLAS reads CUBLAS_WORKSPACE_CONFIG when this process first calls it
    os.environ.update(environment)
    torch.set_num_threads(threads)
    torch.use_deterministic_algorithms(deterministic, warn_only=True)
    COMMANDS[command](connection.send, **kwargs)
    connection.close()


class Child:
    """A fresh process running one command, whose report lines can be awaited with a timeout.

    The process is forked from a forkserver: a separate interpreter, started once, that has
    imported torch and nothing else, so each child starts in milliseconds and shares no memory
    with the notebook. It inherits the notebook's torch thread count, its deterministic-algorithms
    setting and its ``CUBLAS_WORKSPACE_CONFIG``, so that the same recipe computes the same bits.

    Args:
        command: ``"resume"``, ``"write"``, ``"train"`` or ``"ping"``.
        threads: torch threads in the child (default: the parent's).
        **kwargs: the command's keyword arguments.

    Example:
        >>> child = Child("write", recipe=source, settings=settings, path="build/x.pt", mode="atomic")
        >>> child.wait_for("saved", timeout_s=30); child.kill()
    """

    def __init__(self, command: str, threads: int | None = None, **kwargs: Any) -> None:
        if command not in COMMANDS:
            raise ValueError(f"command must be one of {list(COMMANDS)}, got {command!r}")
        context = _context()
        self.command = command
        self.lines: list[str] = []
        self._connection, child_end = context.Pipe(duplex=False)
        environment = {key: os.environ[key] for key in ("CUBLAS_WORKSPACE_CONFIG",) if key in os.environ}
        self.process = context.Process(target=_child_main, daemon=True,
                                       args=(command, kwargs, threads or torch.get_num_threads(),
                                             torch.are_deterministic_algorithms_enabled(), environment, child_end))
        self.process.start()
        child_end.close()   # the child holds the only write end: EOF when it ends

    def wait_for(self, prefix: str, timeout_s: float = 60.0) -> str:
        """The next report line starting with ``prefix``; TimeoutError (child killed) or RuntimeError (it ended)."""
        deadline = time.monotonic() + timeout_s
        while True:
            left = deadline - time.monotonic()
            if left <= 0 or not self._connection.poll(max(0.0, left)):
                self.kill()
                raise TimeoutError(f"{self.command}: no {prefix!r} within {timeout_s} s; last lines {self.lines[-5:]}")
            try:
                line = self._connection.recv()
            except EOFError:
                raise RuntimeError(f"{self.command} ended (exit code {self.finish()}) before {prefix!r}; "
                                   f"last lines {self.lines[-5:]}") from None
            self.lines.append(line)
            if line.startswith(prefix):
                return line

    def remaining_lines(self) -> list[str]:
        """After the child has ended: the report lines not read yet (appended to ``lines`` too)."""
        rest = []
        try:
            while self._connection.poll(0):
                rest.append(self._connection.recv())
        except EOFError:
            pass
        self.lines += rest
        return rest

    def signal(self, signal_number: int) -> None:
        """Send a signal (``signal.SIGTERM``, say) to the child."""
        os.kill(self.process.pid, signal_number)

    def finish(self, timeout_s: float = 60.0) -> int:
        """Wait for the child to exit (killing it after ``timeout_s``); return its exit code."""
        self.process.join(timeout_s)
        if self.process.exitcode is None:
            self.kill()
            raise TimeoutError(f"{self.command} did not exit within {timeout_s} s")
        return self.process.exitcode

    def kill(self) -> int:
        """SIGKILL the child (no handler can run) and reap it; return its exit code (-9)."""
        if self.process.exitcode is None:
            self.process.kill()
        self.process.join(30)
        return self.process.exitcode


class ForkserverWarmUp:
    """Start the forkserver now and time, in a background thread, how long its first (empty) child takes.

    Why: the forkserver's interpreter imports torch for a second or more; started early, that happens
    while the notebook works on, and the time it took (a fresh interpreter, torch imported, a child
    forked) is still measured, as the first part of what a restart after a preemption costs.

    Example:
        >>> warm_up = ForkserverWarmUp()
        >>> ...                          # other work
        >>> warm_up.seconds()            # waits if the server is not ready yet
    """

    def __init__(self) -> None:
        _context()
        self.started = time.monotonic()
        self._seconds: float | None = None
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            child = Child("ping")
            child.wait_for("pong", timeout_s=300)
            self._seconds = time.monotonic() - self.started
            child.finish(timeout_s=60)
        except BaseException as error:  # re-raised by seconds()
            self._error = error

    def seconds(self, timeout_s: float = 300.0) -> float:
        """Seconds from the start to the first child's answer; raises what went wrong, or TimeoutError."""
        self._thread.join(timeout_s)
        if self._error is not None:
            raise self._error
        if self._seconds is None:
            raise TimeoutError(f"the forkserver's first child did not answer within {timeout_s} s")
        return self._seconds
