"""A small resumable training run, and the child processes notebook 12 starts, kills and resumes.

Introduced in notebook 12. The notebook trains here in its own process, saves, and then runs these
commands in *fresh* processes (``Child``: forked from a forkserver that has imported torch, so each
starts in milliseconds), so that nothing a resumed run needs can hide in the notebook's memory. A
reader can run the same commands with ``python -m utils.resume_demo <command> --help``:

- ``resume``: load a checkpoint, continue to the last step, once in full and once for each piece of
  state left out; write the final weights and the losses (``--out``).
- ``write``: save a large checkpoint again and again (in place or atomically) until it is killed.
- ``train``: train until SIGTERM arrives, then save at the next step boundary and exit 0.

The training run itself: a ``utils.MLP`` with dropout (so the RNG matters), AdamW, a learning-rate
schedule with linear warm-up then cosine decay (so the scheduler matters), and a data order shuffled
each epoch by a seeded generator, read batch by batch (so the position in it matters). On CUDA it
runs in fp16 with a GradScaler (so the scaler's state matters).
"""

from __future__ import annotations

import argparse
import copy
import math
import multiprocessing
import os
import threading
import time
from dataclasses import asdict, dataclass
from typing import Any, Callable, Sequence

import torch
import torch.nn.functional as F

from .env import seed_everything
from .models import MLP, make_classification_data
from .state import (PreemptionFlag, capture_training_state, load_checkpoint, restore_rng_state,
                    restore_training_state, save_checkpoint)

PIECES = ("scheduler", "rng", "optimizer", "data")
VARIANTS = {  # name -> the pieces of state a resume leaves out
    "full": (),
    "no scheduler": ("scheduler",),
    "no RNG": ("rng",),
    "no optimizer state": ("optimizer",),
    "no data position": ("data",),
    "BEE-30091's checkpoint": ("rng", "data"),   # model, optimizer, scheduler and step only
}


@dataclass(frozen=True)
class DemoConfig:
    """Sizes and hyper-parameters of the demo run (all plain numbers, so it saves as a dict)."""

    in_features: int = 32
    hidden_features: int = 64
    num_classes: int = 4
    num_hidden_layers: int = 2
    dropout: float = 0.2
    num_samples: int = 256
    batch_size: int = 32
    lr: float = 3e-3
    warmup_steps: int = 8
    total_steps: int = 24
    seed: int = 0          # model initialisation and the RNGs
    data_seed: int = 1     # the data order: epoch e is shuffled by a generator seeded with data_seed + e

    def __post_init__(self) -> None:
        for name in ("in_features", "hidden_features", "num_classes", "num_hidden_layers", "num_samples",
                     "batch_size", "total_steps"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        if self.batch_size > self.num_samples:
            raise ValueError(f"batch_size {self.batch_size} exceeds num_samples {self.num_samples}")
        if not 0 <= self.warmup_steps < self.total_steps:
            raise ValueError(f"warmup_steps must be in [0, total_steps), got {self.warmup_steps}")

    @property
    def batches_per_epoch(self) -> int:
        """Full batches per epoch (the last, partial batch is dropped)."""
        return self.num_samples // self.batch_size


class DemoRun:
    """The live objects of one run: model, optimizer, scheduler, scaler, data and counters.

    Args:
        config: sizes and hyper-parameters.
        device: where to train. On CUDA the run uses fp16 autocast and a GradScaler.
    """

    def __init__(self, config: DemoConfig, device: torch.device | str = "cpu") -> None:
        self.config = config
        self.device = torch.device(device)
        seed_everything(config.seed)
        self.model = MLP(config.in_features, config.hidden_features, config.num_classes,
                         config.num_hidden_layers, dropout=config.dropout).to(self.device)
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=config.lr)
        # linear warm-up then cosine decay: the shape of Hugging Face's get_cosine_schedule_with_warmup
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, self._lr_factor)
        self.use_amp = self.device.type == "cuda"
        self.scaler = torch.amp.GradScaler(self.device.type, enabled=self.use_amp)
        self.inputs, self.labels = make_classification_data(config.num_samples, config.in_features,
                                                            config.num_classes, seed=config.data_seed,
                                                            device=self.device)
        self.step = 0           # optimizer steps taken
        self.epoch = 0          # position in the data order: epoch ...
        self.batch = 0          # ... and batch within it
        self._order: torch.Tensor | None = None

    def _lr_factor(self, step: int) -> float:
        warmup, total = self.config.warmup_steps, self.config.total_steps
        if step < warmup:
            return (step + 1) / warmup
        progress = min(1.0, (step - warmup) / max(1, total - warmup))
        return 0.5 * (1.0 + math.cos(math.pi * progress))

    def _next_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        if self._order is None:  # this epoch's shuffled order, from its own seeded generator
            generator = torch.Generator().manual_seed(self.config.data_seed + self.epoch)
            self._order = torch.randperm(self.config.num_samples, generator=generator)
        size = self.config.batch_size
        rows = self._order[self.batch * size:(self.batch + 1) * size].to(self.device)
        self.batch += 1
        if self.batch == self.config.batches_per_epoch:
            self.epoch, self.batch, self._order = self.epoch + 1, 0, None
        return self.inputs[rows], self.labels[rows]

    def train_steps(self, num_steps: int) -> list[float]:
        """Run ``num_steps`` optimizer steps; return each step's loss."""
        losses = []
        self.model.train()
        for _ in range(num_steps):
            inputs, labels = self._next_batch()
            with torch.autocast(self.device.type, dtype=torch.float16, enabled=self.use_amp):
                loss = F.cross_entropy(self.model(inputs), labels)
            self.scaler.scale(loss).backward()
            self.scaler.step(self.optimizer)
            self.scaler.update()
            self.optimizer.zero_grad(set_to_none=True)
            self.scheduler.step()
            self.step += 1
            losses.append(loss.item())
        return losses

    def checkpoint(self) -> dict[str, Any]:
        """The full training state (``utils.capture_training_state``), with the data position and config."""
        return capture_training_state(self.model, self.optimizer, step=self.step, scheduler=self.scheduler,
                                      scaler=self.scaler, epoch=self.epoch,
                                      data={"seed": self.config.data_seed, "epoch": self.epoch, "batch": self.batch},
                                      extra={"config": asdict(self.config)})

    @classmethod
    def resume(cls, state: dict[str, Any], device: torch.device | str = "cpu",
               drop: Sequence[str] = ()) -> "DemoRun":
        """Build a fresh run and restore ``state`` into it, leaving out the pieces named in ``drop``.

        Args:
            state: a checkpoint from ``DemoRun.checkpoint`` (loaded with ``utils.load_checkpoint``).
            device: where to train.
            drop: any of ``"scheduler"``, ``"rng"``, ``"optimizer"``, ``"data"``. A dropped piece is
                what a fresh process has instead: a new scheduler (warm-up starts again), RNGs seeded
                as at start-up, a new AdamW (no moments, step 0), the data order from epoch 0.
        """
        unknown = set(drop) - set(PIECES)
        if unknown:
            raise ValueError(f"unknown pieces {sorted(unknown)}; choose from {PIECES}")
        state = copy.deepcopy(state)   # optimizer.load_state_dict keeps CPU tensors by reference: keep ours intact
        run = cls(DemoConfig(**state["extra"]["config"]), device)   # seeds the RNGs like a fresh process
        if not drop:
            restore_training_state(state, run.model, run.optimizer, scheduler=run.scheduler, scaler=run.scaler)
        else:
            run.model.load_state_dict(state["model"])
            run.scaler.load_state_dict(state["scaler"])
            if "optimizer" not in drop:
                run.optimizer.load_state_dict(state["optimizer"])
            if "scheduler" not in drop:
                run.scheduler.load_state_dict(state["scheduler"])
            if "rng" not in drop:
                restore_rng_state(state["rng"])
        run.step = state["step"]
        if "data" not in drop:
            run.epoch, run.batch = state["data"]["epoch"], state["data"]["batch"]
        return run


def flat_weights(model: torch.nn.Module) -> torch.Tensor:
    """All parameters as one fp32 CPU vector (to compare runs)."""
    return torch.cat([p.detach().float().cpu().reshape(-1) for p in model.parameters()])


# --- what the child processes do ----------------------------------------------------------------
# Each command reports progress through ``report(line)``: print() on the command line, a pipe to
# the notebook when started by ``Child``.

def resume_command(report: Callable[[str], None], *, checkpoint: str, out: str, device: str = "cpu",
                   variants: Sequence[str] = tuple(VARIANTS)) -> None:
    """Load ``checkpoint``, finish the run once per variant, save final weights and losses to ``out``."""
    started = time.perf_counter()
    state = load_checkpoint(checkpoint)
    load_s = time.perf_counter() - started
    report(f"loaded step {state['step']} in {load_s:.6f} s")
    outcome: dict[str, Any] = {"load_s": load_s, "variants": {}}
    for name in variants:
        if name not in VARIANTS:
            raise ValueError(f"unknown variant {name!r}; choose from {list(VARIANTS)}")
        run = DemoRun.resume(state, device, drop=VARIANTS[name])
        losses = run.train_steps(run.config.total_steps - run.step)
        outcome["variants"][name] = {"weights": flat_weights(run.model), "losses": torch.tensor(losses),
                                     "final_step": run.step}
    save_checkpoint(outcome, out)
    report(f"resumed from step {state['step']}: {len(outcome['variants'])} variants written to {out}")


def write_command(report: Callable[[str], None], *, path: str, mode: str, megabytes: float = 32.0) -> None:
    """Save a checkpoint of about ``megabytes`` MiB again and again (``mode`` "inplace" or "atomic"), forever."""
    if mode not in ("inplace", "atomic"):
        raise ValueError(f"mode must be 'inplace' or 'atomic', got {mode!r}")
    side = int(math.sqrt(megabytes * 2**20 / 4))
    model = torch.nn.Linear(side, side, bias=False)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    report(f"ready {side}")
    step = 0
    while True:   # back-to-back saves, so a kill almost surely lands inside one
        step += 1
        state = capture_training_state(model, optimizer, step=step)
        started = time.perf_counter()
        if mode == "atomic":
            report(f"writing {step}")
            save_checkpoint(state, path)
        else:
            # what torch.save(state, path) does: open (which empties the file), then write; reporting
            # between the two tells the parent that from now until the close the file is incomplete
            with open(path, "wb") as file:
                report(f"writing {step}")
                torch.save(state, file)
        report(f"saved {step} {time.perf_counter() - started:.6f}")


def train_command(report: Callable[[str], None], *, path: str, device: str = "cpu", step_sleep_s: float = 0.01) -> None:
    """Train until SIGTERM arrives, then save the full state at the next step boundary and return."""
    run = DemoRun(DemoConfig(total_steps=10**9), device)   # endless: it stops on SIGTERM
    with PreemptionFlag() as preempted:
        while not preempted.requested:
            run.train_steps(1)
            if run.step == 3:
                report("training")
            time.sleep(step_sleep_s)                        # stands in for a longer step
        started = time.perf_counter()
        save_checkpoint(run.checkpoint(), path)             # at a step boundary: a consistent state
        waited_s = time.monotonic() - preempted.received_at
    report(f"preempted step {run.step} save_s {time.perf_counter() - started:.6f} since_signal_s {waited_s:.6f}")


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
            raise RuntimeError("the demo's child processes need the 'forkserver' start method (Linux, macOS); "
                               "run `python -m utils.resume_demo` yourself on other systems")
        _FORKSERVER = multiprocessing.get_context("forkserver")
        _FORKSERVER.set_forkserver_preload(["utils.resume_demo", "torch._dynamo"])  # optimizers import it
    return _FORKSERVER


def _child_main(command: str, kwargs: dict[str, Any], threads: int, connection: Any) -> None:
    # the same thread count as the parent: a reduction split differently rounds differently. On CUDA
    # the same kernels on the same GPU and one stream give the same bits; nothing else to set here
    torch.set_num_threads(threads)
    COMMANDS[command](connection.send, **kwargs)
    connection.close()


class Child:
    """A fresh process running one command, whose report lines can be awaited with a timeout.

    The process is forked from a forkserver: a separate interpreter, started once, that has
    imported torch and nothing else, so each child starts in milliseconds and shares no memory
    with the notebook. On the command line, ``python -m utils.resume_demo`` runs the same commands.

    Args:
        command: ``"resume"``, ``"write"`` or ``"train"``.
        threads: torch threads in the child (default: the parent's, so the arithmetic is identical).
        **kwargs: the command's keyword arguments.

    Example:
        >>> child = Child("write", path="build/x.pt", mode="atomic")
        >>> child.wait_for("saved", timeout_s=30); child.kill()
    """

    def __init__(self, command: str, threads: int | None = None, **kwargs: Any) -> None:
        if command not in COMMANDS:
            raise ValueError(f"command must be one of {list(COMMANDS)}, got {command!r}")
        context = _context()
        self.command = command
        self.lines: list[str] = []
        self._connection, child_end = context.Pipe(duplex=False)
        self.process = context.Process(target=_child_main, daemon=True,
                                       args=(command, kwargs, threads or torch.get_num_threads(), child_end))
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


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m utils.resume_demo {resume,write,train} ...``: see the module docstring."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    resume = sub.add_parser("resume", help="load a checkpoint and finish the run, with and without each piece")
    resume.add_argument("--checkpoint", required=True)
    resume.add_argument("--out", required=True)
    resume.add_argument("--variants", default=",".join(VARIANTS), help="comma-separated")
    write = sub.add_parser("write", help="save a large checkpoint again and again until killed")
    write.add_argument("--path", required=True)
    write.add_argument("--mode", choices=("inplace", "atomic"), required=True)
    write.add_argument("--megabytes", type=float, default=32.0)
    train = sub.add_parser("train", help="train until SIGTERM, then save and exit 0")
    train.add_argument("--path", required=True)
    train.add_argument("--step-sleep-s", type=float, default=0.01, help="seconds added to each step")
    for command in (resume, train):
        command.add_argument("--device", default="cpu")
    for command in (resume, write, train):
        command.add_argument("--threads", type=int, default=torch.get_num_threads())
    args = vars(parser.parse_args(argv))
    command, threads = args.pop("command"), args.pop("threads")
    if "variants" in args:
        args["variants"] = args["variants"].split(",")
    _child_main(command, args, threads, _Printer())
    return 0


class _Printer:
    """Stands in for the pipe on the command line."""

    def send(self, line: str) -> None:
        print(line, flush=True)

    def close(self) -> None:
        pass


if __name__ == "__main__":
    raise SystemExit(main())
