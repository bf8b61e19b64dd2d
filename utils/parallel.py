"""Data-parallel training on several ranks, predicted and launched: ZeRO's formulas, the torchrun launcher.

Introduced in notebook 12, with ``utils.distributed`` (the training script this module launches).

* ``predict_zero_bytes_per_rank`` and ``predict_communication_bytes``: the ZeRO paper's per-rank
  model-state bytes for stages 0-3 and the bytes each rank sends per step, built on
  ``utils.bytes_per_parameter``.
* ``launch``: runs ``python -m torch.distributed.run --standalone --nproc-per-node N -m
  utils.distributed ...`` as a subprocess with a timeout and reads every rank's JSON back; a
  failing rank makes it raise ``LaunchError`` with that rank's error, never hang. The script may
  use this module; this module never imports the script (one rank in-process is
  ``utils.distributed.launch_in_this_process``).
* ``RunConfig``, ``step_indices``, ``train_single_process``: what every rank trains, and the
  single-process reference (one process, the whole global batch) it must agree with.

Strategies (ZeRO stage in brackets): ``ddp`` (0: everything replicated, gradients all-reduced),
``zero1`` (1: DDP plus ``ZeroRedundancyOptimizer``, optimizer state partitioned by whole
parameters), ``fsdp`` (3: FSDP2's ``fully_shard`` per layer, parameters re-sharded after forward),
``fsdp-no-reshard`` (3, ``reshard_after_forward=False``: all-gathered parameters kept from forward
to backward, one all-gather less).
"""

from __future__ import annotations

import json
import math
import os
import re
import signal
import socket
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence

import torch

from .checks import non_negative_int, positive_int
from .footprint import bytes_per_parameter
from .models import MLP, make_classification_data

STRATEGIES = ("ddp", "zero1", "fsdp", "fsdp-no-reshard")
ZERO_STAGE = {"ddp": 0, "zero1": 1, "fsdp": 3, "fsdp-no-reshard": 3}
TORCHRUN_VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
KILLED_EXIT_CODE = 17          # the exit status of a rank killed on purpose mid-save (--kill-rank)
CHECKPOINT_STRATEGY = "fsdp"   # the run that saves and resumes sharded checkpoints


def check_strategy(strategy: str) -> str:
    """Return ``strategy`` if it is one of ``STRATEGIES``; a ValueError naming them otherwise."""
    if strategy not in STRATEGIES:
        raise ValueError(f"unknown strategy {strategy!r}: expected one of {STRATEGIES}")
    return strategy


def check_world_size(world_size: int, hidden: int) -> None:
    """Check that the model (every layer ``hidden`` wide) splits evenly over ``world_size`` ranks.

    FSDP2 shards each parameter along its first dimension and would pad an uneven split; the
    script refuses one so that every rank holds exactly 1/N of every parameter and the per-rank
    predictions are exact.

    Raises:
        ValueError: ``world_size`` is not a positive int, or does not divide ``hidden``.
    """
    positive_int("world_size", world_size)
    if hidden % world_size:
        raise ValueError(f"a model {hidden} wide cannot be split over {world_size} ranks: expected a world size "
                         f"that divides {hidden} (every parameter's first dimension)")


# --- predictions ------------------------------------------------------------------------------------

@dataclass(frozen=True)
class ZeroFootprint:
    """Predicted bytes one rank holds for the model state under a ZeRO stage.

    Attributes:
        stage: 0 (DDP), 1 (optimizer state sharded), 2 (and gradients), 3 (and parameters: FSDP).
        world_size: ranks N.
        params_bytes, grads_bytes, master_bytes, optimizer_bytes: bytes per rank by role.
    """

    stage: int
    world_size: int
    params_bytes: int
    grads_bytes: int
    master_bytes: int
    optimizer_bytes: int

    @property
    def total_bytes(self) -> int:
        """All model-state bytes on one rank."""
        return self.params_bytes + self.grads_bytes + self.master_bytes + self.optimizer_bytes


def predict_zero_bytes_per_rank(num_parameters: int, world_size: int, stage: int, *, optimizer: str = "adamw",
                                precision: str = "fp32", num_tensors: int = 0) -> ZeroFootprint:
    """The ZeRO paper's per-rank model-state bytes (Rajbhandari et al. 2020, figure 1).

    With K = optimizer bytes (+ master copy) per parameter and Ψ parameters on N ranks:
    stage 0 holds (w + g + K)Ψ, stage 1 (w + g)Ψ + KΨ/N, stage 2 wΨ + (g + K)Ψ/N,
    stage 3 (w + g + K)Ψ/N, with w, g, K from ``utils.bytes_per_parameter``.

    Args:
        num_parameters: Ψ, parameter elements of the whole model.
        world_size: N, ranks (GPUs).
        stage: 0, 1, 2 or 3.
        optimizer, precision: as in ``utils.bytes_per_parameter`` (mixed = 16-bit weights and
            gradients, fp32 master weights and state: 16 bytes per parameter for AdamW).
        num_tensors: parameter tensors, for Adam's 4-byte ``step`` counter per tensor: every rank
            holds one per tensor at stage 0 and 3 (stage 3 shards every tensor), and 1/N of them at
            stages 1 and 2 (``ZeroRedundancyOptimizer`` partitions whole tensors; rounded up).
            0 leaves them out, as the paper does.

    Returns:
        A ``ZeroFootprint``.

    Example:
        >>> predict_zero_bytes_per_rank(7 * 10**9, 8, 3, precision="mixed").total_bytes / 1e9
        14.0
    """
    positive_int("num_parameters", num_parameters)
    positive_int("world_size", world_size)
    non_negative_int("num_tensors", num_tensors)
    if stage not in (0, 1, 2, 3):
        raise ValueError(f"stage must be 0, 1, 2 or 3 (ZeRO's stages), got {stage!r}")
    per = bytes_per_parameter(optimizer, precision)
    step_bytes = 4 if optimizer in ("adam", "adamw") else 0
    counters = step_bytes * (num_tensors if stage in (0, 3) else math.ceil(num_tensors / world_size))

    def share(bytes_per_param: int, sharded: bool) -> int:
        total = bytes_per_param * num_parameters
        return math.ceil(total / world_size) if sharded else total

    return ZeroFootprint(stage=stage, world_size=world_size,
                         params_bytes=share(per.weights, stage >= 3),
                         grads_bytes=share(per.grads, stage >= 2),
                         master_bytes=share(per.master, stage >= 1),
                         optimizer_bytes=share(per.optimizer, stage >= 1) + counters)


def predict_communication_bytes(num_parameters: int, world_size: int, strategy: str,
                                bytes_per_element: int = 4) -> int:
    """Bytes one rank sends per optimizer step with ring collectives.

    A ring all-reduce of B bytes sends 2(N-1)/N·B per rank (a reduce-scatter, then an all-gather,
    each (N-1)/N·B). DDP all-reduces the gradients once. ZeRO-1 (``ZeroRedundancyOptimizer``)
    all-reduces them too, then broadcasts each rank's updated parameters: (N-1)/N·B more.
    FSDP all-gathers the parameters in forward, again in backward (after re-sharding), and
    reduce-scatters the gradients: 3(N-1)/N·B, 1.5x DDP; without re-sharding, 2(N-1)/N·B.

    Args:
        num_parameters: Ψ, parameter elements.
        world_size: N.
        strategy: one of ``STRATEGIES``.
        bytes_per_element: of the communicated gradients and parameters (4 in fp32, 2 in bf16).

    Returns:
        Predicted bytes sent by each rank per step (0 at N = 1).
    """
    check_strategy(strategy)
    positive_int("world_size", world_size)
    volume = num_parameters * bytes_per_element
    passes = {"ddp": 2, "zero1": 3, "fsdp": 3, "fsdp-no-reshard": 2}[strategy]
    return passes * (world_size - 1) * volume // world_size


# --- what every rank trains, and the single-process reference ---------------------------------------

@dataclass
class RunConfig:
    """What every rank trains; the notebook's single-process reference uses the same fields."""

    hidden: int = 64
    layers: int = 4                 # Linear layers (MLP with layers - 1 hidden blocks)
    micro_batch: int = 8            # samples per rank per micro-batch
    accumulation_steps: int = 1     # micro-batches per optimizer step (DDP no_sync / FSDP no grad sync)
    steps: int = 4                  # optimizer steps
    steps_per_epoch: int = 2        # the data set holds this many global batches (set_epoch between)
    lr: float = 1e-2
    seed: int = 0

    def global_batch(self, world_size: int) -> int:
        """Samples per optimizer step over all ranks."""
        return world_size * self.micro_batch * self.accumulation_steps


def make_model(config: RunConfig) -> torch.nn.Sequential:
    """The model every rank builds (same seed, same weights): ``layers`` Linear layers ``hidden`` wide, ReLU between.

    ``utils.MLP``'s layers: the same ``nn.Sequential`` (same keys, same initial weights) as the launched script's
    own ``make_model``, which notebook 12 checks.
    """
    torch.manual_seed(config.seed)
    return MLP(config.hidden, config.hidden, config.hidden, num_hidden_layers=config.layers - 1).layers


def make_dataset(config: RunConfig, world_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The synthetic data set: ``steps_per_epoch`` global batches of (hidden,) features, hidden classes."""
    samples = config.global_batch(world_size) * config.steps_per_epoch
    return make_classification_data(samples, config.hidden, config.hidden, seed=config.seed + 1)


def epoch_order(num_samples: int, world_size: int, rank: int, epoch: int, seed: int) -> list[int]:
    """The sample indices ``DistributedSampler(shuffle=True)`` gives ``rank`` in ``epoch``."""
    from torch.utils.data.distributed import DistributedSampler

    sampler = DistributedSampler(range(num_samples), num_replicas=world_size, rank=rank, shuffle=True, seed=seed)
    sampler.set_epoch(epoch)
    return list(sampler)


def step_indices(config: RunConfig, world_size: int, rank: int, step: int) -> list[list[int]]:
    """The micro-batches (lists of sample indices) ``rank`` trains on at optimizer step ``step``."""
    samples = config.global_batch(world_size) * config.steps_per_epoch
    epoch, within = divmod(step, config.steps_per_epoch)
    order = epoch_order(samples, world_size, rank, epoch, config.seed)
    per_step = config.micro_batch * config.accumulation_steps
    chunk = order[within * per_step:(within + 1) * per_step]
    return [chunk[i * config.micro_batch:(i + 1) * config.micro_batch] for i in range(config.accumulation_steps)]


def train_single_process(config: RunConfig, world_size: int) -> tuple[dict[str, torch.Tensor], list[float]]:
    """The reference: one process, no process group, batch ``world_size · micro_batch · accumulation``.

    It visits the same samples per step as ``world_size`` ranks together, in one batch.

    Returns:
        ``(state_dict, losses)``: the final weights and each step's loss.
    """
    model = make_model(config)
    optimizer = torch.optim.AdamW(model.parameters(), lr=config.lr, foreach=False)
    features, labels = make_dataset(config, world_size)
    losses = []
    for step in range(config.steps):
        indices = [i for rank in range(world_size) for micro in step_indices(config, world_size, rank, step)
                   for i in micro]
        batch = torch.tensor(indices)
        loss = torch.nn.functional.cross_entropy(model(features[batch]), labels[batch])
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return model.state_dict(), losses


def latest_complete_checkpoint(directory: Path | str) -> Path | None:
    """The newest ``step_NNNNNN`` folder in ``directory`` (a ``.partial`` one was never finished)."""
    folder = Path(directory)
    if not folder.is_dir():
        return None
    complete = sorted(p for p in folder.iterdir() if p.is_dir() and re.fullmatch(r"step_\d{6}", p.name))
    return complete[-1] if complete else None


# --- the launcher the notebook uses -------------------------------------------------------------------

class LaunchError(RuntimeError):
    """A torchrun launch failed or timed out; the message holds the failing rank's error.

    Attributes:
        returncode: torchrun's exit status (None after a timeout).
        stderr: everything the launch printed to stderr.
        result: a ``LaunchResult`` with what the ranks wrote before the failure.
    """

    def __init__(self, message: str, returncode: int | None, stderr: str, result: "LaunchResult | None" = None) -> None:
        super().__init__(message)
        self.returncode = returncode
        self.stderr = stderr
        self.result = result


@dataclass
class LaunchResult:
    """What ``launch`` returns.

    Attributes:
        command: the command line that ran.
        seconds: wall time of the launch (process start included).
        ranks: run label -> the per-rank JSON records, by rank.
        out: the folder holding them (and ``<label>_weights.pt``).
        stderr: what torchrun and the ranks printed to stderr.
        started_at: when the launch began (``time.time()``, seconds since the epoch): compare with
            the ranks' ``wall_start_s`` to see how long starting the processes took.
    """

    command: list[str]
    seconds: float
    ranks: dict[str, list[dict]] = field(default_factory=dict)
    out: Path | None = None
    stderr: str = ""
    started_at: float = 0.0


def find_free_port() -> int:
    """A TCP port on 127.0.0.1 that is free now (the OS picks it; another process may take it later)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def check_port_free(port: int) -> None:
    """Raise an OSError naming ``port`` if something on 127.0.0.1 listens on it already."""
    if isinstance(port, bool) or not isinstance(port, int) or not 0 < port < 65536:
        raise ValueError(f"port must be an int in 1..65535, got {port!r}")
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            raise OSError(f"port {port} on 127.0.0.1 is in use: expected a free port "
                          "(pass port=None to let torchrun pick one, or utils.parallel.find_free_port())") from None


def rank_errors(stderr: str, max_lines: int = 25) -> str:
    """The failing rank's error out of a torchrun launch's stderr.

    torchrun's summary names the first rank that failed ("Root Cause"); this returns that rank's
    own lines (its ``[rankN]:`` traceback, or what it printed as ``rank N: ...``), the last
    ``max_lines`` of them, then one line per rank with its exit code.
    """
    lines = stderr.splitlines()
    root = None
    if "Root Cause" in stderr:
        found = re.search(r"rank\s*:\s*(\d+)", stderr[stderr.index("Root Cause"):])
        root = int(found.group(1)) if found else None
    ranks = []
    for line in lines:
        match = re.match(r"\[rank(\d+)\]:|rank (\d+): ", line)
        if match:
            ranks.append(int(match.group(1) or match.group(2)))
    chosen = root if root is not None else (min(ranks) if ranks else None)
    own = [line for line in lines if chosen is not None and
           (line.startswith(f"[rank{chosen}]:") or line.startswith(f"rank {chosen}: "))]
    codes = [f"rank {m.group(1)}: exit code {m.group(2)}" for m in
             re.finditer(r"rank\s*:\s*(\d+)\s*\(local_rank: \d+\)\s*\n\s*exitcode\s*:\s*(-?\d+)", stderr)]
    head = [f"first failure: rank {chosen}"] if chosen is not None else []
    return "\n".join(head + own[-max_lines:] + sorted(set(codes)))


def torchrun_command(nproc: int, script_args: Sequence[str], port: int | None = None) -> list[str]:
    """``python -m torch.distributed.run --standalone --nproc-per-node N -m utils.distributed ...``.

    With ``port`` the rendezvous uses that port on 127.0.0.1 instead of ``--standalone``'s free one.
    """
    positive_int("nproc", nproc)
    rendezvous = (["--standalone"] if port is None else
                  ["--nnodes", "1", "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}"])
    return [sys.executable, "-m", "torch.distributed.run", *rendezvous, "--nproc-per-node", str(nproc),
            "-m", "utils.distributed", *[str(a) for a in script_args]]


def script_arguments(*, strategies: Sequence[str], out: Path | str, hidden: int = 64, layers: int = 4,
                     micro_batch: int = 8, steps: int = 4, steps_per_epoch: int = 2,
                     accumulation_steps: Sequence[int] = (1,), lr: float = 1e-2, seed: int = 0,
                     checkpoint_dir: Path | str | None = None, save_every: int = 0, kill_rank: int | None = None,
                     collective_timeout_s: float = 30.0) -> list[str]:
    """The command-line arguments of a measured launch of ``python -m utils.distributed`` (``--device`` aside).

    Args:
        strategies: one or more of ``STRATEGIES``, run one after another in the same processes.
        out: the folder for the results.
        hidden, layers, micro_batch, steps, steps_per_epoch, accumulation_steps, lr, seed: the run.
        checkpoint_dir: the ``fsdp`` run saves sharded checkpoints here, and resumes from the newest one
            it finds there (the script's own behaviour).
        save_every: steps between checkpoints (0: only after the last step).
        kill_rank: after the checkpointed run, this rank dies while saving one more step (a simulated
            preemption; the launch then fails with that rank's error).
        collective_timeout_s: each collective's limit inside the ranks, seconds.

    Raises:
        ValueError: an unknown strategy, or ``kill_rank`` without ``checkpoint_dir``.
    """
    for strategy in strategies:
        check_strategy(strategy)
    if kill_rank is not None and checkpoint_dir is None:
        raise ValueError("kill_rank needs checkpoint_dir: the rank is killed while it writes a checkpoint")
    args = ["--strategy", ",".join(strategies), "--accumulation-steps", ",".join(str(k) for k in accumulation_steps),
            "--hidden", hidden, "--layers", layers, "--micro-batch", micro_batch, "--steps", steps,
            "--steps-per-epoch", steps_per_epoch, "--lr", lr, "--seed", seed, "--out", out,
            "--timeout-s", collective_timeout_s, "--save-every", save_every]
    if checkpoint_dir is not None:
        args += ["--checkpoint-dir", checkpoint_dir]
    if kill_rank is not None:
        args += ["--kill-rank", kill_rank]
    return [str(a) for a in args]


def check_new_results_folder(out: Path | str) -> Path:
    """``out`` as a Path if it holds no results yet; a FileExistsError otherwise (results are never overwritten)."""
    out = Path(out)
    if out.exists() and any(out.glob("*_rank*.json")):
        raise FileExistsError(f"{out} holds results already: expected a new folder (remove it yourself to rerun)")
    return out


def launch(nproc: int, *, strategies: Sequence[str], out: Path | str, hidden: int = 64, device: str = "auto",
           timeout_s: float = 120.0, port: int | None = None, **run: object) -> LaunchResult:
    """Launch the training script on ``nproc`` ranks with torchrun and read back every rank's JSON.

    Everything is checked before a process starts (strategies, world size against the model,
    port, the results folder), so a wrong argument is a ValueError here rather than a failed
    launch. One rank needs no launcher: ``utils.distributed.launch_in_this_process`` runs it inside
    the calling process (this module does not import the script it launches).

    Args:
        nproc: ranks (processes) on this machine.
        strategies: one or more of ``STRATEGIES``, run one after another in the same processes.
        out: a new folder for the results (an existing one with results in it is refused).
        hidden: width of every layer (must be divisible by ``nproc``).
        device: ``"auto"``, ``"cpu"`` (gloo) or ``"cuda"`` (NCCL, one GPU per rank).
        timeout_s: the whole launch's limit, seconds: beyond it every process is killed.
        port: ``None`` lets torchrun's ``--standalone`` rendezvous take a free port; a number
            must be free (else OSError).
        **run: the rest of the run, as ``script_arguments`` takes it (``layers``, ``micro_batch``,
            ``steps``, ``steps_per_epoch``, ``accumulation_steps``, ``lr``, ``seed``, ``checkpoint_dir``,
            ``save_every``, ``kill_rank``, ``collective_timeout_s``).

    Returns:
        A ``LaunchResult``.

    Raises:
        LaunchError: a rank failed (the message holds its error) or the launch timed out.

    Example:
        >>> result = launch(2, strategies=["ddp"], out=utils.build_dir() / "12_ddp")
        >>> result.ranks["ddp"][1]["categories"]
    """
    args = script_arguments(strategies=strategies, out=out, hidden=hidden, **run)
    check_world_size(nproc, hidden)
    if device not in ("auto", "cpu", "cuda"):
        raise ValueError(f"device must be 'auto', 'cpu' or 'cuda', got {device!r}")
    if port is not None:
        check_port_free(port)
    out = check_new_results_folder(out)
    command = torchrun_command(nproc, [*args, "--device", device], port)
    environment = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"),
                   "PYTHONUNBUFFERED": "1", "MPLBACKEND": "Agg"}
    started_at, began = time.time(), time.perf_counter()
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                               env=environment, start_new_session=True)   # its own group: killable as one
    try:
        stdout, stderr = process.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        stdout, stderr = process.communicate()
        partial = read_results(LaunchResult([str(c) for c in command], time.perf_counter() - began, out=out,
                                            stderr=stderr, started_at=started_at))
        raise LaunchError(f"the launch did not finish in {timeout_s} s and was killed (every rank); "
                          f"rank errors so far:\n{rank_errors(stderr) or stderr[-2000:]}", None, stderr,
                          partial) from None
    result = read_results(LaunchResult([str(c) for c in command], time.perf_counter() - began, out=out,
                                       stderr=stderr, started_at=started_at))
    if process.returncode != 0:
        raise LaunchError(f"torchrun exited with status {process.returncode}; the failing rank said:\n"
                          f"{rank_errors(stderr) or stderr[-3000:]}", process.returncode, stderr, result)
    return result


def read_results(result: LaunchResult) -> LaunchResult:
    """Fill ``result.ranks`` from the ``<label>_rank<r>.json`` files in ``result.out`` (sorted by rank); returns it."""
    out = result.out
    for path in sorted(out.glob("*_rank*.json")) if out.exists() else []:
        record = json.loads(path.read_text())
        result.ranks.setdefault(record["label"], []).append(record)
    for records in result.ranks.values():
        records.sort(key=lambda r: r["rank"])
    return result


def median_step_ms(records: Sequence[dict]) -> float:
    """The median step time over every rank's steps (measured under the memory tracker)."""
    return statistics.median(ms for record in records for ms in record["step_ms"])
