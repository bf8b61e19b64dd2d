"""The training script notebook 12 launches: data-parallel training with DDP, ZeRO-1 or FSDP2, measured per rank.

Run it under torchrun, on a node with one GPU per rank (NCCL) or on a CPU (gloo ranks)::

    python -m torch.distributed.run --standalone --nproc-per-node 8 -m utils.distributed \\
        --strategy fsdp --hidden 4096 --layers 8 --micro-batch 16 --steps 50 --out build/12_run

Read it top to bottom:

1. **The recipe**, what each strategy changes in an ordinary training script: ``wrap_model`` (DDP, or
   FSDP2's ``fully_shard`` per layer), ``make_optimizer`` (ZeRO-1's ``ZeroRedundancyOptimizer``) and
   ``train_step`` (gradient accumulation that synchronises once per step: ``no_sync`` for DDP,
   ``set_requires_gradient_sync`` for FSDP2). Notebook 12 shows these three functions and checks that
   its copy is exactly this code.
2. **Sharded checkpoints**: ``save_checkpoint`` and ``load_checkpoint`` (``torch.distributed.checkpoint``,
   written atomically: a folder renamed when every rank has written its shards).
3. **One run**: ``run_one`` builds the model on every rank (same seed, same weights), trains it with
   ``train_step`` on the rank's shard of the data (``DistributedSampler``'s order, from
   ``utils.parallel.step_indices``), measures, and writes ``<out>/<run>_rank<r>.json``: the bytes the
   rank held at the end of its last step by category (parameters, gradients, optimizer state, the
   rest), the losses, the bytes its collectives carried, when the run began and ended (wall clock).
   Rank 0 also writes ``<out>/<run>_weights.pt`` (the full weights).
4. **What a rank measures**: memory with ``utils.measure_memory`` (the exact tracker on the CPU, the
   CUDA allocator on a GPU), the collectives and their bytes, and what a barrier leaves alive.
5. **The command line**: ``main`` under torchrun; ``launch_in_this_process`` runs one CPU rank inside
   the calling process (no launcher is needed for N = 1).

``utils.parallel`` predicts what this script measures and launches it; this script uses
``utils.parallel`` (the run's configuration and data), never the other way round. A single GPU
cannot host two NCCL ranks: with fewer GPUs than ranks the script runs every rank on the CPU.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import json
import os
import shutil
import sys
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any, Sequence

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils._python_dispatch import TorchDispatchMode

from .memory import measure_memory, tensor_bytes
from .parallel import (CHECKPOINT_STRATEGY, KILLED_EXIT_CODE, STRATEGIES, TORCHRUN_VARIABLES, LaunchResult, RunConfig,
                       check_new_results_folder, check_world_size, latest_complete_checkpoint, make_dataset,
                       make_model, read_results, script_arguments, step_indices)
from .state import _fsync_directory


# --- 1. the recipe: what each strategy changes in a training script ------------------------------------------

def wrap_model(model: nn.Module, strategy: str, device: torch.device, mesh: DeviceMesh | None) -> nn.Module:
    """Where the model is built: DDP keeps a whole copy per rank; FSDP2 shards every layer over the mesh's ranks."""
    if strategy in ("ddp", "zero1"):
        # backward all-reduces the gradients in buckets, so every rank ends the step with the same average
        return DDP(model, device_ids=[device.index] if device.type == "cuda" else None)
    reshard = strategy == "fsdp"        # "fsdp-no-reshard" keeps the gathered parameters from forward to backward
    for layer in model.layers:
        if isinstance(layer, nn.Linear):
            fully_shard(layer, mesh=mesh, reshard_after_forward=reshard)   # each rank keeps 1/N of the layer
    fully_shard(model, mesh=mesh, reshard_after_forward=reshard)            # the root: whatever is left
    return model


def make_optimizer(model: nn.Module, strategy: str, lr: float) -> torch.optim.Optimizer:
    """Where the optimizer is built: ZeRO-1 gives each rank the AdamW state of its share of the parameters."""
    if strategy == "zero1":
        return ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.AdamW, lr=lr, foreach=False)
    return torch.optim.AdamW(model.parameters(), lr=lr, foreach=False)   # FSDP2's parameters are shards already


def train_step(model: nn.Module, optimizer: torch.optim.Optimizer, micro_batches: list, strategy: str) -> float:
    """One optimizer step over (inputs, targets) micro-batches; gradients are synchronised after the last only."""
    optimizer.zero_grad(set_to_none=True)
    total = 0.0
    for index, (inputs, targets) in enumerate(micro_batches):
        last = index == len(micro_batches) - 1
        if strategy.startswith("fsdp"):
            model.set_requires_gradient_sync(last)     # FSDP2: no reduce-scatter before the last backward
        skip_sync = strategy in ("ddp", "zero1") and not last
        with model.no_sync() if skip_sync else contextlib.nullcontext():   # DDP: no all-reduce until the last
            # divide: the gradients of the micro-batches add up (notebook 02)
            loss = F.cross_entropy(model(inputs), targets) / len(micro_batches)
            loss.backward()
        total += loss.item()
    optimizer.step()            # ZeRO-1: each rank updates its share, then broadcasts it to the others
    return total


# --- 2. sharded checkpoints --------------------------------------------------------------------------------------

def _state(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model_state, optimizer_state = get_state_dict(model, optimizer)
    return {"model": model_state, "optimizer": optimizer_state}


def save_checkpoint(model: nn.Module, optimizer: torch.optim.Optimizer, directory: Path, step: int, *,
                    kill_rank: int | None = None) -> Path:
    """Save a sharded checkpoint with ``torch.distributed.checkpoint``, atomically.

    Every rank writes its shards into ``step_NNNNNN.partial``; after a barrier rank 0 renames it to
    ``step_NNNNNN`` (one atomic rename, as notebook 14 does for single files). A rank that dies
    mid-save leaves only a ``.partial`` folder, which ``latest_complete_checkpoint`` ignores.

    Args:
        model, optimizer: the (sharded) model and its optimizer.
        directory: the folder holding the checkpoints.
        step: the step the checkpoint is saved after (its folder's name).
        kill_rank: this rank exits (status ``KILLED_EXIT_CODE``) while writing: a simulated
            preemption, to show that the previous checkpoint stays loadable.

    Returns:
        The complete checkpoint's folder.

    Raises:
        FileExistsError: a checkpoint of that step exists already (it is never overwritten).
    """
    import torch.distributed.checkpoint as dcp

    final = directory / f"step_{step:06d}"
    partial = directory / f"step_{step:06d}.partial"
    rank = dist.get_rank()
    if rank == 0:
        if final.exists():
            raise FileExistsError(f"{final} exists already: expected a new step (refusing to overwrite it)")
        shutil.rmtree(partial, ignore_errors=True)   # what a killed earlier attempt left
        partial.mkdir(parents=True)
    dist.barrier()

    class Writer(dcp.FileSystemWriter):
        def write_data(self, plan, planner):  # noqa: ANN001, ANN202
            if rank == kill_rank:
                (partial / f"__{rank}_half_written.distcp").write_bytes(b"\0" * 64)
                print(f"rank {rank}: killed while writing checkpoint step {step} (simulated preemption)",
                      file=sys.stderr, flush=True)
                os._exit(KILLED_EXIT_CODE)
            return super().write_data(plan, planner)

    dcp.save(_state(model, optimizer), storage_writer=Writer(str(partial)))
    dist.barrier()
    if rank == 0:
        os.replace(partial, final)                 # atomic: readers see no folder or a complete one
        _fsync_directory(Path(directory))          # make the rename itself durable (POSIX)
    dist.barrier()
    return final


def load_checkpoint(model: nn.Module, optimizer: torch.optim.Optimizer, directory: Path) -> int:
    """Load the latest complete checkpoint in ``directory`` into (sharded) model and optimizer.

    The checkpoint may have been written by any number of ranks: DCP reshards on load.

    Returns:
        The step it was saved after.

    Raises:
        FileNotFoundError: no complete checkpoint in ``directory``.
    """
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import set_state_dict

    latest = latest_complete_checkpoint(directory)
    if latest is None:
        raise FileNotFoundError(f"no complete checkpoint (a step_NNNNNN folder) in {directory}")
    state = _state(model, optimizer)
    dcp.load(state, checkpoint_id=str(latest))
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"])
    return int(latest.name.split("_")[1])


# --- 3. one run: build, train, measure, write --------------------------------------------------------------------

def _full_state_dict(model: nn.Module, strategy: str) -> dict[str, torch.Tensor]:
    if strategy in ("ddp", "zero1"):
        return {k: v.detach().cpu().clone() for k, v in model.module.state_dict().items()}
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))   # a collective for FSDP
    return {k: v.detach().cpu().clone() for k, v in full.items()}


def run_one(config: RunConfig, strategy: str, out: Path, *, device: torch.device, label: str,
            save_at: Sequence[int] = (), checkpoint_dir: Path | None = None, resume_from: Path | None = None,
            kill_rank: int | None = None) -> dict[str, Any]:
    """Train one strategy on this rank (inside an initialised process group) with ``train_step``; write its JSON.

    Measured from before the model is built (the exact tracker on the CPU, watching storages that FSDP2
    frees with ``resize_(0)``; the allocator on CUDA): the bytes each step's first forward adds, the bytes
    alive at the end of the last step, by category; the collectives of every step; the step times.
    """
    wall_start_s = time.time()   # wall clock, comparable with LaunchResult.started_at
    rank, world_size = dist.get_rank(), dist.get_world_size()
    features, labels = make_dataset(config, world_size)   # before the region: the data is not model state
    # FSDP2's ranks as a 1-D mesh, made once per process (it keeps a small tensor alive: not model state either)
    mesh = init_device_mesh(device.type, (world_size,)) if strategy.startswith("fsdp") else None
    hook_counter: dict[str, int] = {}
    counter = CollectiveCounter(world_size)
    losses, step_ms, first_indices, forward_added, forward_live = [], [], [], [], []
    region = measure_memory(device, timeline=False, **({"watch_resizes": True} if device.type == "cpu" else {}))
    with region as memory:
        model = wrap_model(make_model(config).to(device), strategy, device, mesh)
        if isinstance(model, DDP):
            model.register_comm_hook(None, make_counting_hook(hook_counter))   # counts each gradient bucket
        # the bytes alive when each forward begins and ends (FSDP's own hooks run first: the end is after its reshard)
        model.register_forward_pre_hook(lambda *_: forward_live.append(_live_bytes(region)))
        model.register_forward_hook(lambda *_: forward_live.append(_live_bytes(region)))
        optimizer = make_optimizer(model, strategy, config.lr)
        start_step = load_checkpoint(model, optimizer, resume_from) if resume_from is not None else 0
        for step in range(start_step, config.steps):
            indices = step_indices(config, world_size, rank, step)   # this rank's micro-batches of the global batch
            first_indices = first_indices or indices
            micro_batches = [(features[i].to(device), labels[i].to(device)) for i in map(torch.tensor, indices)]
            began = time.perf_counter()
            with counter:
                losses.append(train_step(model, optimizer, micro_batches, strategy))
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            step_ms.append((time.perf_counter() - began) * 1e3)
            forward_added.append(forward_live[1] - forward_live[0])   # what the step's first forward added
            forward_live.clear()
            del micro_batches
            end_of_step = _live_bytes(region)       # after optimizer.step(), the gradients still alive
            zero_byte_storages = _zero_byte_storages(region)
            if step + 1 in save_at and step + 1 < config.steps and checkpoint_dir is not None:
                save_checkpoint(model, optimizer, checkpoint_dir, step + 1,
                                kill_rank=kill_rank if step + 1 == max(save_at) else None)
    # a checkpoint saved inside the region ran barriers: what the last of them left behind is "other"
    saved_in_region = checkpoint_dir is not None and any(start_step < s < config.steps for s in save_at)
    barrier_bytes = barrier_retained_bytes(device) if saved_in_region else 0
    record = _record(model, optimizer, config, strategy, label, device, start_step, end_of_step, barrier_bytes)
    record.update(zero_byte_storages=zero_byte_storages, peak_bytes=memory.peak_bytes, losses=losses, step_ms=step_ms,
                  forward_added_bytes=forward_added, first_step_indices=first_indices,
                  wall_start_s=wall_start_s)
    steps_run = max(config.steps - start_step, 1)
    record["comm"] = {"hook_bucket_bytes_per_step": hook_counter.get("bytes", 0) / steps_run, "calls": counter.calls,
                      "payload_bytes": counter.payload_bytes, "ring_sent_bytes_per_step": counter.sent_bytes / steps_run}
    _write_results(model, strategy, out, label, record)
    if config.steps in save_at and checkpoint_dir is not None:    # the final checkpoint, after the results
        dist.barrier()
        save_checkpoint(model, optimizer, checkpoint_dir, config.steps,
                        kill_rank=kill_rank if config.steps == max(save_at) else None)
    del model, optimizer
    dist.barrier()
    return record


def _record(model: nn.Module, optimizer: torch.optim.Optimizer, config: RunConfig, strategy: str, label: str,
            device: torch.device, start_step: int, end_of_step: int, barrier_bytes: int) -> dict[str, Any]:
    """What the rank held at the end of its last step, by category, and what describes the run."""
    params = list(model.parameters())
    local_optimizer = getattr(optimizer, "optim", optimizer)   # ZeroRedundancyOptimizer keeps this rank's AdamW
    state_tensors = [v for s in local_optimizer.state.values() for v in s.values() if isinstance(v, torch.Tensor)]
    owned = [p for group in local_optimizer.param_groups for p in group["params"]]
    categories = {"params": local_bytes(params), "grads": local_bytes([p.grad for p in params]),
                  "optimizer": local_bytes(state_tensors)}
    categories["other"] = end_of_step - sum(categories.values())
    sharded_state = [v for v in state_tensors if hasattr(v, "to_local")]
    return {
        "label": label, "strategy": strategy, "rank": dist.get_rank(), "world_size": dist.get_world_size(),
        "device": str(device), "backend": dist.get_backend(), "config": asdict(config), "start_step": start_step,
        "num_parameters": sum(p.numel() for p in params), "num_tensors": len(params),
        "owned_numel": sum(_local(p).numel() for p in owned), "owned_tensors": len(owned),
        "end_of_step_bytes": end_of_step, "categories": categories, "barrier_retained_bytes": barrier_bytes,
        # what a tracker that counted DTensors at their logical size would have seen instead of the shards
        "sharded_state_logical_bytes": sum(v.numel() * v.element_size() for v in sharded_state),
        "sharded_state_local_bytes": local_bytes(sharded_state),
        "logical_param_bytes": sum(p.numel() * p.element_size() for p in params),
    }


def _write_results(model: nn.Module, strategy: str, out: Path, label: str, record: dict[str, Any]) -> None:
    full = _full_state_dict(model, strategy)          # a collective for FSDP: every rank takes part
    record["weight_checksum"] = float(sum(v.double().sum() for v in full.values()))
    if record["rank"] == 0:
        torch.save(full, out / f"{label}_weights.pt")
    record["wall_end_s"] = time.time()
    (out / f"{label}_rank{record['rank']}.json").write_text(json.dumps(record, indent=1) + "\n")


# --- 4. what a rank measures ------------------------------------------------------------------------------------

# bytes each rank sends in a ring implementation, as a multiple of the tensor bytes passed in
_RING_FACTORS = {"allreduce_": lambda n: 2 * (n - 1) / n, "_allgather_base_": lambda n: (n - 1) / n,
                 "_reduce_scatter_base_": lambda n: (n - 1) / n, "broadcast_": lambda n: (n - 1) / n}


class CollectiveCounter(TorchDispatchMode):
    """Counts the c10d collectives a region issues, the bytes they carry and a ring's bytes sent.

    c10d's collectives are dispatcher operators (``c10d.allreduce_``, ``c10d._allgather_base_``,
    ...), so a ``TorchDispatchMode`` sees each one with its tensors. For all-gathers the payload
    counted is the gathered output; for reduce-scatters the input; otherwise the tensors passed.

    Args:
        world_size: the ranks N, for the ring factors (an all-reduce sends 2(N-1)/N of its bytes).

    Known limitations:
        Collectives issued from C++ without the dispatcher (DDP's reducer without a Python comm
        hook) are not seen: ``make_counting_hook`` counts those.
    """

    def __init__(self, world_size: int) -> None:
        super().__init__()
        self.world_size = world_size
        self.calls: dict[str, int] = {}
        self.payload_bytes: dict[str, int] = {}
        self.sent_bytes = 0.0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
        kwargs = kwargs or {}
        if getattr(func, "namespace", "") == "c10d":
            name = func._schema.name.split("::")[-1]
            payload = _collective_payload(name, args)
            self.calls[name] = self.calls.get(name, 0) + 1
            self.payload_bytes[name] = self.payload_bytes.get(name, 0) + payload
            factor = _RING_FACTORS.get(name)
            if factor is not None:
                self.sent_bytes += factor(self.world_size) * payload
        return func(*args, **kwargs)


def _collective_payload(name: str, args: Sequence[Any]) -> int:
    def nbytes(obj: Any) -> int:
        if isinstance(obj, torch.Tensor):
            return obj.numel() * obj.element_size()
        if isinstance(obj, (list, tuple)):
            return sum(nbytes(item) for item in obj)
        return 0
    if name in ("_allgather_base_", "_reduce_scatter_base_"):
        return nbytes(args[0] if name == "_allgather_base_" else args[1])  # output / input
    return nbytes(args[0]) if args else 0


def make_counting_hook(counter: dict[str, int]):  # noqa: ANN201 - a DDP comm hook
    """A DDP communication hook: counts each bucket's bytes, then all-reduces it as DDP does.

    Args:
        counter: a dict; ``counter["bytes"]`` and ``counter["buckets"]`` are incremented.
    """
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

    def hook(state, bucket):  # noqa: ANN001, ANN202 - DDP checks annotations: leave them out
        buffer = bucket.buffer()
        counter["bytes"] = counter.get("bytes", 0) + buffer.numel() * buffer.element_size()
        counter["buckets"] = counter.get("buckets", 0) + 1
        return allreduce_hook(state, bucket)
    return hook


def _local(tensor: torch.Tensor) -> torch.Tensor:
    """The local shard of a DTensor, or the tensor itself."""
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor


def local_bytes(tensors: Sequence[torch.Tensor | None]) -> int:
    """Bytes of the distinct storages behind the local parts of some tensors (DTensors by shard)."""
    return tensor_bytes([_local(tensor) for tensor in tensors if tensor is not None])


def _zero_byte_storages(region: measure_memory) -> int:
    """How many storages the tracker follows that are alive with 0 bytes (freed by ``resize_(0)``)."""
    live = getattr(region._mode, "live", None)
    return sum(1 for nbytes in live.values() if nbytes == 0) if live is not None else 0


def _live_bytes(region: measure_memory) -> int:
    """What a running ``measure_memory`` region holds right now (re-reading resized storages)."""
    mode = region._mode
    if hasattr(mode, "reconcile"):
        mode.reconcile()
        return mode.recorder.current
    return torch.cuda.memory_allocated(region.device) - region.measurement.baseline_bytes


def barrier_retained_bytes(device: torch.device) -> int:
    """Bytes that a ``dist.barrier()`` leaves alive after it returns, measured (a collective: every rank calls it).

    A barrier is an all-reduce of a one-element ``uint8`` tensor that the process group allocates. torch 2.11's
    ``ProcessGroup`` keeps the last barrier's tensor alive until the next barrier replaces it (1 byte on the CPU
    tracker; one 512-byte block on CUDA); torch 2.13 frees it on return (0). A region that calls a barrier
    (a checkpoint save does) ends with these bytes in it, though they are neither model state nor activations.

    Returns:
        What two barriers in a row left above the bytes alive before them.
    """
    with measure_memory(device) as probe:
        dist.barrier()
        dist.barrier()       # the second one frees the first's tensor where a backend keeps only the last
    return probe.end_bytes


# --- 5. the command line ----------------------------------------------------------------------------------------

def require_torchrun_environment() -> dict[str, str]:
    """The variables torchrun sets for each rank; a RuntimeError naming the missing ones otherwise."""
    missing = [name for name in TORCHRUN_VARIABLES if name not in os.environ]
    if missing:
        raise RuntimeError(
            f"utils.distributed must run under torchrun: {', '.join(missing)} not set. Expected e.g. "
            "`python -m torch.distributed.run --standalone --nproc-per-node 2 -m utils.distributed "
            "--strategy ddp --out DIR` (or utils.parallel.launch from Python)")
    return {name: os.environ[name] for name in TORCHRUN_VARIABLES}


def _int_list(text: str) -> list[int]:
    try:
        return [int(item) for item in text.split(",") if item.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None


def _strategy_list(text: str) -> list[str]:
    names = [item.strip() for item in text.split(",") if item.strip()]
    for name in names:
        if name not in STRATEGIES:
            raise argparse.ArgumentTypeError(f"unknown strategy {name!r}: expected one of {STRATEGIES}")
    return names


def build_parser() -> argparse.ArgumentParser:
    """The command line of ``python -m utils.distributed`` (run it under torchrun)."""
    parser = argparse.ArgumentParser(prog="python -m utils.distributed", description=__doc__.split("\n")[0])
    parser.add_argument("--strategy", type=_strategy_list, required=True,
                        help=f"one or more of {', '.join(STRATEGIES)}, comma-separated: run one after another")
    parser.add_argument("--accumulation-steps", type=_int_list, default=[1],
                        help="micro-batches per optimizer step: one value, or one per strategy")
    parser.add_argument("--hidden", type=int, default=64, help="width of every layer (divisible by the world size)")
    parser.add_argument("--layers", type=int, default=4, help="Linear layers")
    parser.add_argument("--micro-batch", type=int, default=8, help="samples per rank per micro-batch")
    parser.add_argument("--steps", type=int, default=4, help="optimizer steps")
    parser.add_argument("--steps-per-epoch", type=int, default=2, help="global batches in the data set")
    parser.add_argument("--lr", type=float, default=1e-2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, required=True, help="folder for the per-rank JSON and the weights")
    parser.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto",
                        help="auto: one GPU per rank when there are enough, else the CPU (gloo)")
    parser.add_argument("--timeout-s", type=float, default=60.0, help="timeout of every collective, seconds")
    parser.add_argument("--save-at", type=_int_list, default=[],
                        help=f"steps after which the {CHECKPOINT_STRATEGY!r} run saves a DCP checkpoint")
    parser.add_argument("--checkpoint-dir", type=Path, default=None)
    parser.add_argument("--resume-from", type=Path, default=None,
                        help=f"the {CHECKPOINT_STRATEGY!r} run resumes from the latest complete checkpoint here")
    parser.add_argument("--kill-rank", type=int, default=None,
                        help="this rank exits while writing the last --save-at checkpoint (simulated preemption)")
    parser.add_argument("--overwrite", action="store_true", help="replace results already in --out")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``python -m utils.distributed`` (under torchrun); returns the exit status.

    Raises:
        RuntimeError: not started by torchrun (its variables are missing), or more ranks than
            GPUs with ``--device cuda``.
        ValueError: a world size the model cannot be split over, or inconsistent arguments.
    """
    args = build_parser().parse_args(argv)
    environment = require_torchrun_environment()
    return _run(args, int(environment["RANK"]), int(environment["WORLD_SIZE"]), int(environment["LOCAL_RANK"]))


def run_in_this_process(argv: Sequence[str]) -> int:
    """Run the script as a one-rank job inside the calling process (no torchrun, no new process).

    N = 1 needs no launcher: this creates a one-rank gloo process group on an in-memory store,
    runs exactly what ``main`` runs, and destroys the group. ``--device`` is forced to the CPU.

    Raises:
        RuntimeError: a process group exists already in this process.
    """
    if dist.is_initialized():
        raise RuntimeError("a process group exists already in this process: expected none")
    args = build_parser().parse_args([*argv, "--device", "cpu"])
    return _run(args, 0, 1, 0, store=dist.HashStore())


def launch_in_this_process(*, strategies: Sequence[str], out: Path | str, **run: Any) -> LaunchResult:
    """Like ``utils.parallel.launch`` with one CPU rank, but inside the calling process: no process to start.

    Args:
        strategies, out, **run: as ``utils.parallel.script_arguments`` takes them.

    Returns:
        A ``LaunchResult`` (its command starts with ``"(in this process)"``).

    Raises:
        FileExistsError: ``out`` holds results already. ValueError: bad arguments.

    Example:
        >>> result = launch_in_this_process(strategies=["ddp"], out=utils.build_dir() / "12_one_rank")
    """
    args = script_arguments(strategies=strategies, out=out, **run)
    out = check_new_results_folder(out)
    started_at, began = time.time(), time.perf_counter()
    run_in_this_process(args)
    return read_results(LaunchResult(command=["(in this process)", *args], seconds=time.perf_counter() - began,
                                     out=out, started_at=started_at))


def _run(args: argparse.Namespace, rank: int, world_size: int, local_rank: int, store: Any = None) -> int:
    check_world_size(world_size, args.hidden)
    accumulation = args.accumulation_steps
    if len(accumulation) == 1:
        accumulation = accumulation * len(args.strategy)
    if len(accumulation) != len(args.strategy) or any(k < 1 for k in accumulation):
        raise ValueError(f"--accumulation-steps: expected 1 or {len(args.strategy)} positive values, "
                         f"got {accumulation}")
    if args.save_at and args.checkpoint_dir is None:
        raise ValueError("--save-at needs --checkpoint-dir")
    use_cuda = args.device == "cuda" or (args.device == "auto" and torch.cuda.device_count() >= world_size)
    if use_cuda and torch.cuda.device_count() < world_size:
        raise RuntimeError(f"--device cuda with {world_size} ranks needs {world_size} GPUs (NCCL: one GPU per rank), "
                           f"found {torch.cuda.device_count()}")
    device = torch.device("cuda", local_rank) if use_cuda else torch.device("cpu")
    if use_cuda:
        torch.cuda.set_device(device)
    labels = [s if k == 1 else f"{s}-accum{k}" for s, k in zip(args.strategy, accumulation)]
    if len(set(labels)) != len(labels):
        raise ValueError(f"each run needs its own strategy/accumulation pair, got {labels}")
    existing = [label for label in labels if (args.out / f"{label}_rank{rank}.json").exists()]
    if existing and not args.overwrite:
        raise FileExistsError(f"{args.out} holds results for {existing} already: expected a new folder, or --overwrite")
    args.out.mkdir(parents=True, exist_ok=True)
    timeout = dt.timedelta(seconds=args.timeout_s)
    if store is None:
        dist.init_process_group("nccl" if use_cuda else "gloo", timeout=timeout)
    else:
        dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size, timeout=timeout)
    try:
        for strategy, k, label in zip(args.strategy, accumulation, labels):
            config = RunConfig(hidden=args.hidden, layers=args.layers, micro_batch=args.micro_batch,
                               accumulation_steps=k, steps=args.steps, steps_per_epoch=args.steps_per_epoch,
                               lr=args.lr, seed=args.seed)
            checkpointing = strategy == CHECKPOINT_STRATEGY and k == 1
            run_one(config, strategy, args.out, device=device, label=label,
                    save_at=args.save_at if checkpointing else (),
                    checkpoint_dir=args.checkpoint_dir if checkpointing else None,
                    resume_from=args.resume_from if checkpointing else None,
                    kill_rank=args.kill_rank if checkpointing else None)
    finally:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
