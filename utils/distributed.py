"""The training script notebook 12 launches (DDP, ZeRO-1 or FSDP2), and the per-rank measuring wrapped around it.

A reader runs the script itself, on a node with one GPU per rank (NCCL) or on a CPU (gloo ranks)::

    torchrun --standalone --nproc-per-node 8 -m utils.distributed --strategy fsdp --hidden 4096 --layers 8 \\
        --micro-batch 16 --accumulation-steps 2 --steps 50 --checkpoint-dir build/12_run/checkpoints

Read it top to bottom:

1. **The script** (between the ``# --- the script`` lines): a complete data-parallel training script that
   imports only torch. Part 1 joins the process group (``start``: the device, the backend, FSDP2's mesh) and
   makes the data and its ``DistributedSampler``; part 2 the model, ``wrap_model`` (DDP with
   ``gradient_as_bucket_view=True``, or FSDP2's ``fully_shard`` per block, any model whose blocks you pass),
   ``make_optimizer`` (ZeRO-1's ``ZeroRedundancyOptimizer``) and ``train_step`` (accumulation that
   synchronises gradients once per step, one device-to-host sync per step, gradients freed at the end of the
   step); part 3 sharded checkpoints (``torch.distributed.checkpoint``, written atomically) and the loop,
   which resumes from the newest complete checkpoint. Notebook 12 shows these three parts as its three
   recipe cells and checks that they are this text, and the ranks record a hash of the text they ran.
2. **The measuring**, wrapped around the script from outside it: ``measured_main`` (what
   ``utils.parallel.launch`` starts: the script's arguments plus ``--out``) calls the script's own ``start``,
   ``make_data``, ``make_model`` and ``train`` inside ``utils.measure_memory`` and watches them through hooks
   torch offers globally (an optimizer-step post-hook, forward hooks on the model, a ``TorchDispatchMode``
   that counts collectives), then writes ``<out>/<run>_rank<r>.json`` and rank 0 the full weights.

``utils.parallel`` predicts what this measures and launches it; this module uses ``utils.parallel``, never
the other way round. A single GPU cannot host two NCCL ranks: with fewer GPUs than ranks every rank runs on
the CPU.
"""
# --- the script, part 1 of 3: the process group, the device, the data and its sampler ---------------------------
# Expects: nothing from your script (this part imports what all three use); torchrun sets RANK, WORLD_SIZE, LOCAL_RANK
import argparse
import contextlib
import datetime
import itertools
import os
import shutil
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn.functional as F
from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

STRATEGIES = ("ddp", "zero1", "fsdp", "fsdp-no-reshard")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The script's command line (``argv`` None: ``sys.argv``)."""
    parser = argparse.ArgumentParser(description="data-parallel training: DDP, ZeRO-1 or FSDP2 (run it with torchrun)")
    parser.add_argument("--strategy", choices=STRATEGIES, default="fsdp")
    parser.add_argument("--hidden", type=int, default=64, help="width of every layer")
    parser.add_argument("--layers", type=int, default=4, help="Linear layers")
    parser.add_argument("--micro-batch", type=int, default=8, help="samples per rank per backward pass")
    parser.add_argument("--accumulation-steps", type=int, default=1, help="micro-batches per optimizer step")
    parser.add_argument("--steps", type=int, default=4, help="optimizer steps in all (a resumed run counts on)")
    parser.add_argument("--steps-per-epoch", type=int, default=2, help="global batches in the synthetic data set")
    parser.add_argument("--lr", type=float, default=1e-2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--checkpoint-dir", type=Path, default=None, help="resume from here if it holds a checkpoint")
    parser.add_argument("--save-every", type=int, default=0, help="steps between checkpoints (0: the last step only)")
    parser.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    parser.add_argument("--timeout-s", type=float, default=60.0, help="a collective waiting longer raises")
    return parser.parse_args(argv)


def start(world_size: int, local_rank: int, device: str = "auto",
          timeout_s: float = 60.0) -> tuple[torch.device, DeviceMesh]:
    """Join the job torchrun started: one GPU per rank with NCCL when there are enough, else the CPU with gloo."""
    use_cuda = device == "cuda" or (device == "auto" and torch.cuda.device_count() >= world_size)
    if use_cuda and torch.cuda.device_count() < world_size:
        raise RuntimeError(f"--device cuda with {world_size} ranks needs {world_size} GPUs (NCCL: one GPU per "
                           f"rank), found {torch.cuda.device_count()}")
    rank_device = torch.device("cuda", local_rank) if use_cuda else torch.device("cpu")
    if use_cuda:
        torch.cuda.set_device(rank_device)     # before the process group: NCCL binds each rank to its GPU
    dist.init_process_group("nccl" if use_cuda else "gloo", timeout=datetime.timedelta(seconds=timeout_s))
    return rank_device, init_device_mesh(rank_device.type, (world_size,))   # FSDP2 shards over this 1-D mesh


def make_data(samples: int, width: int, seed: int) -> TensorDataset:
    """``samples`` (features, label) pairs, ``width`` features and classes."""
    # replace with your data set: here features and labels from a fixed random linear teacher, the same on every rank
    generator = torch.Generator().manual_seed(seed)
    features = torch.randn(samples, width, generator=generator)
    teacher = torch.randn(width, width, generator=generator) / width**0.5
    return TensorDataset(features, (features @ teacher).argmax(dim=1))


def make_loader(dataset: TensorDataset, batch_size: int, seed: int) -> DataLoader:
    """Batches of this rank's share of the data set, in an order that changes with ``loader.sampler.set_epoch``."""
    # each rank takes a disjoint 1/N of every epoch's shuffle (the same permutation everywhere: same seed)
    sampler = DistributedSampler(dataset, shuffle=True, seed=seed)
    return DataLoader(dataset, batch_size=batch_size, sampler=sampler)


# --- the script, part 2 of 3: the model, the optimizer and the step -------------------------------------------------
# Expects: part 1's imports; your model's repeated blocks; targets aligned with the logits (-100: padding, ignored)
def make_model(width: int, layers: int, seed: int) -> tuple[nn.Module, list[nn.Module]]:
    """The model and the blocks FSDP2 shards one by one."""
    # replace with your model; return it with its repeated blocks (a transformers model: model.model.layers)
    torch.manual_seed(seed)                     # the same initial weights on every rank
    modules: list[nn.Module] = []
    for _ in range(layers - 1):
        modules += [nn.Linear(width, width), nn.ReLU()]
    model = nn.Sequential(*modules, nn.Linear(width, width))
    return model, [module for module in model if isinstance(module, nn.Linear)]


def wrap_model(model: nn.Module, blocks: list[nn.Module], strategy: str, device: torch.device,
               mesh: DeviceMesh) -> nn.Module:
    """DDP keeps a whole copy of the model per rank; FSDP2 shards each block (then the rest) over the ranks."""
    if dist.get_world_size() > 1 and any(isinstance(m, nn.modules.batchnorm._BatchNorm) for m in model.modules()):
        if device.type != "cuda":   # each rank's BatchNorm would normalise with its own samples' statistics
            raise ValueError("BatchNorm on CPU ranks: each would normalise with its own samples' statistics, not the "
                             "global batch's; expected GPU ranks (the script converts to nn.SyncBatchNorm, CUDA "
                             "only) or a norm without batch statistics (GroupNorm, LayerNorm)")
        model = nn.SyncBatchNorm.convert_sync_batchnorm(model)   # statistics over the global batch
    model = model.to(device)
    if strategy in ("ddp", "zero1"):
        # backward all-reduces the gradients in buckets; gradient_as_bucket_view: the gradients *are* the buckets
        return DDP(model, device_ids=[device.index] if device.type == "cuda" else None, gradient_as_bucket_view=True)
    reshard = strategy == "fsdp"                # "fsdp-no-reshard" keeps gathered parameters from forward to backward
    for block in blocks:
        fully_shard(block, mesh=mesh, reshard_after_forward=reshard)   # each rank keeps 1/N of every block
    fully_shard(model, mesh=mesh, reshard_after_forward=reshard)       # the root: whatever is left (embeddings, head)
    return model


def make_optimizer(model: nn.Module, strategy: str, lr: float) -> torch.optim.Optimizer:
    """AdamW, or ZeRO-1's ``ZeroRedundancyOptimizer`` around it."""
    # ZeRO-1: each rank keeps AdamW's state for its share of the parameters; FSDP2's parameters are shards already
    # (foreach=False: no temporary copy of the state during the update, so the bytes per rank are exact)
    if strategy == "zero1":
        return ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.AdamW, lr=lr, foreach=False)
    return torch.optim.AdamW(model.parameters(), lr=lr, foreach=False)


def logits_of(output: torch.Tensor | object) -> torch.Tensor:
    """The logits of a model's output."""
    return getattr(output, "logits", output)            # a transformers model returns an output object


def split_batch(inputs: torch.Tensor | dict[str, torch.Tensor], size: int) -> list:
    """A tensor, or a dict of tensors (input_ids, attention_mask, ...), cut into pieces of ``size`` rows."""
    if isinstance(inputs, dict):
        return [dict(zip(inputs, values)) for values in zip(*(value.split(size) for value in inputs.values()))]
    return list(inputs.split(size))


def train_step(model: nn.Module, optimizer: torch.optim.Optimizer, inputs: torch.Tensor | dict[str, torch.Tensor],
               targets: torch.Tensor, micro_batch: int, strategy: str) -> torch.Tensor:
    """One optimizer step on this rank's batch, in micro-batches: gradients synchronised once, freed at the end."""
    pieces = list(zip(split_batch(inputs, micro_batch), targets.split(micro_batch)))
    # the mean over the targets that count on *all* ranks (notebook 02): padding (-100) is spread unevenly over the
    # ranks, so each divides its summed loss by the global count, times N because DDP's all-reduce and FSDP's
    # reduce-scatter average the ranks' gradients: the N terms add up to the global batch's mean
    targets_in_step = (targets != -100).sum()           # a tensor: counting them does not wait for the GPU
    dist.all_reduce(targets_in_step)                    # one integer per step, summed over the ranks
    total = torch.zeros((), device=targets.device)
    for index, (piece_inputs, piece_targets) in enumerate(pieces):
        last = index == len(pieces) - 1
        if strategy.startswith("fsdp"):
            model.set_requires_gradient_sync(last)          # FSDP2: reduce-scatter after the last backward only
        with model.no_sync() if strategy in ("ddp", "zero1") and not last else contextlib.nullcontext():
            output = model(**piece_inputs) if isinstance(piece_inputs, dict) else model(piece_inputs)
            logits = logits_of(output).flatten(0, -2).float()  # (tokens or samples, classes)
            del output                                  # a local name would keep the logits alive until the step ends
            # summed, not averaged: right for an uneven last piece and for padding; freed logits before backward
            loss = F.cross_entropy(logits, piece_targets.flatten(), reduction="sum") * dist.get_world_size()
            loss, logits = loss / targets_in_step, None
            loss.backward()                             # DDP: the all-reduce happens here, on the last piece
        total += loss.detach()                          # stays on the device: no synchronisation per micro-batch
    optimizer.step()                                    # ZeRO-1: each rank updates its share, then broadcasts it
    optimizer.zero_grad(set_to_none=True)               # free the gradients now, not at the next step (notebook 07)
    return total                                        # N x this rank's share: the mean over ranks is the loss


# --- the script, part 3 of 3: sharded checkpoints and the loop -----------------------------------------------------
# Expects: parts 1 and 2 (replace make_data and make_model there with your data set and your model)
def save_checkpoint(model: nn.Module, optimizer: torch.optim.Optimizer, folder: Path, step: int) -> Path:
    """Every rank writes its shards into step_NNNNNN.partial; rank 0 renames it once all have (atomic, notebook 16)."""
    final, partial = folder / f"step_{step:06d}", folder / f"step_{step:06d}.partial"
    if dist.get_rank() == 0:
        shutil.rmtree(partial, ignore_errors=True)      # what a rank killed in an earlier attempt left
    dist.barrier()
    model_state, optimizer_state = get_state_dict(model, optimizer)   # DTensor shards for FSDP, no copy
    dcp.save({"model": model_state, "optimizer": optimizer_state}, checkpoint_id=partial)
    dist.barrier()                                      # every rank has written its shards
    if dist.get_rank() == 0:
        os.replace(partial, final)                      # readers see no folder or a complete one
        descriptor = os.open(folder, os.O_RDONLY)       # make the rename itself durable (POSIX)
        os.fsync(descriptor)
        os.close(descriptor)
    dist.barrier()
    return final


def load_checkpoint(model: nn.Module, optimizer: torch.optim.Optimizer, folder: Path | None) -> int:
    """Load the newest complete checkpoint in ``folder`` (written by any number of ranks); the step it ends, or 0."""
    complete = sorted(folder.glob("step_[0-9]*[0-9]")) if folder is not None and folder.is_dir() else []
    if not complete:
        return 0
    model_state, optimizer_state = get_state_dict(model, optimizer)
    state = {"model": model_state, "optimizer": optimizer_state}
    dcp.load(state, checkpoint_id=complete[-1])         # each rank reads what its own shards need
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"])
    return int(complete[-1].name.split("_")[1])


def train(model: nn.Module, blocks: list[nn.Module], dataset: TensorDataset, device: torch.device,
          mesh: DeviceMesh, args: argparse.Namespace) -> tuple[nn.Module, list[float]]:
    """Wrap, resume if there is a checkpoint, train ``args.steps`` steps in epochs, checkpoint; the losses per step."""
    if args.strategy == "zero1" and args.checkpoint_dir is not None:
        raise ValueError("zero1 cannot checkpoint with get_state_dict (ZeroRedundancyOptimizer needs "
                         "consolidate_state_dict): expected ddp, fsdp or fsdp-no-reshard with --checkpoint-dir")
    model = wrap_model(model, blocks, args.strategy, device, mesh)
    optimizer = make_optimizer(model, args.strategy, args.lr)
    step = load_checkpoint(model, optimizer, args.checkpoint_dir)   # 0 without a checkpoint
    loader = make_loader(dataset, args.micro_batch * args.accumulation_steps, args.seed)
    losses = []
    while step < args.steps:
        loader.sampler.set_epoch(step // len(loader))   # a new order each epoch (forget it: every epoch repeats)
        for inputs, targets in itertools.islice(loader, step % len(loader), None):   # resumed: skip what was trained
            loss = train_step(model, optimizer, inputs.to(device), targets.to(device), args.micro_batch, args.strategy)
            losses.append(loss.item())                  # one synchronisation per step, for the log
            del loss, inputs, targets                   # nothing of this step stays alive into the next
            step += 1
            due = step == args.steps or (args.save_every > 0 and step % args.save_every == 0)
            if args.checkpoint_dir is not None and due:
                save_checkpoint(model, optimizer, args.checkpoint_dir, step)
            if step == args.steps:
                break
    return model, losses


def main(argv: list[str] | None = None) -> None:
    """``torchrun --nproc-per-node N script.py --strategy fsdp --checkpoint-dir DIR``: train, resuming where it was."""
    args = parse_args(argv)
    if "LOCAL_RANK" not in os.environ:
        raise RuntimeError("run me under torchrun (RANK, WORLD_SIZE, LOCAL_RANK not set): expected e.g. "
                           "`torchrun --standalone --nproc-per-node 2 script.py --strategy fsdp`")
    world_size = int(os.environ["WORLD_SIZE"])
    device, mesh = start(world_size, int(os.environ["LOCAL_RANK"]), args.device, args.timeout_s)
    try:
        dataset = make_data(world_size * args.micro_batch * args.accumulation_steps * args.steps_per_epoch,
                            args.hidden, args.seed + 1)
        model, blocks = make_model(args.hidden, args.layers, args.seed)
        _, losses = train(model, blocks, dataset, device, mesh, args)
        if dist.get_rank() == 0:
            print(f"{args.strategy} on {world_size} rank(s): loss per step {[round(x, 4) for x in losses]}")
    finally:
        dist.destroy_process_group()
# --- end of the script ----------------------------------------------------------------------------------------


# === the measuring, wrapped around the script (none of it is needed to train) ====================================

import hashlib  # noqa: E402 - the measuring's own imports come after the script it wraps
import json  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from dataclasses import asdict  # noqa: E402
from typing import Any, Sequence  # noqa: E402

from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

from .memory import measure_memory, tensor_bytes  # noqa: E402
from .parallel import (CHECKPOINT_STRATEGY, KILLED_EXIT_CODE, TORCHRUN_VARIABLES, LaunchResult,  # noqa: E402
                       RunConfig, check_new_results_folder, check_world_size, find_free_port, read_results,
                       script_arguments)

SCRIPT_BEGIN = "# --- the script, part 1 of 3"
SCRIPT_END = "# --- end of the script"


def script_source() -> str:
    """The script's text: this file from its first ``# --- the script`` line to the line before its end marker.

    Notebook 12's three recipe cells, joined by two blank lines, are this text (the notebook asserts it).
    """
    text = Path(__file__).read_text()
    return text[text.index(SCRIPT_BEGIN):text.index(SCRIPT_END)].rstrip() + "\n"


def script_sha256() -> str:
    """The SHA-256 of ``script_source()``: each rank records it, so a notebook can check what the ranks ran."""
    return hashlib.sha256(script_source().encode()).hexdigest()


# --- what a rank measures ---------------------------------------------------------------------------------------

# bytes each rank sends in a ring implementation, as a multiple of the tensor bytes passed in
_RING_FACTORS = {"allreduce_": lambda n: 2 * (n - 1) / n, "_allgather_base_": lambda n: (n - 1) / n,
                 "_reduce_scatter_base_": lambda n: (n - 1) / n, "broadcast_": lambda n: (n - 1) / n}


class CollectiveCounter(TorchDispatchMode):
    """Counts the c10d collectives a region issues, the bytes they carry and a ring's bytes sent.

    c10d's collectives are dispatcher operators (``c10d.allreduce_``, ``c10d._allgather_base_``,
    ...), so a ``TorchDispatchMode`` sees each one with its tensors. For all-gathers the payload
    counted is the gathered output; for reduce-scatters the input; otherwise the tensors passed.
    Only what runs while ``counting`` is True is counted (the wrapper turns it on for the steps, not
    for the checkpoints between them).

    Args:
        world_size: the ranks N, for the ring factors (an all-reduce sends 2(N-1)/N of its bytes).

    Known limitations:
        Collectives issued from C++ without the dispatcher (DDP's reducer without a Python comm
        hook) are not seen: ``make_counting_hook`` counts those.
    """

    def __init__(self, world_size: int) -> None:
        super().__init__()
        self.world_size = world_size
        self.counting = True
        self.calls: dict[str, int] = {}
        self.payload_bytes: dict[str, int] = {}
        self.sent_bytes = 0.0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
        kwargs = kwargs or {}
        if self.counting and getattr(func, "namespace", "") == "c10d":
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


def gathered_parameter_bytes(model: nn.Module) -> int:
    """Bytes of the full (all-gathered, not DTensor) parameter storages a module holds now.

    Under FSDP2 a block's parameters are DTensor shards at rest; while the block runs, and after
    its forward when ``reshard_after_forward=False``, they are whole tensors whose storage FSDP2
    later frees with ``resize_(0)``. Read from the parameters themselves, this does not depend on
    when a background thread frees a collective's buffers (what the live bytes do).
    """
    storages = {}
    for parameter in model.parameters():
        if not hasattr(parameter, "to_local"):       # a DTensor is a shard at rest: not gathered
            storage = parameter.untyped_storage()
            storages[storage.data_ptr()] = storage.nbytes()   # a freed (resized to 0) storage counts 0
    return sum(storages.values())


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


class StepWatcher:
    """Watches the script's steps from outside, through hooks torch offers; reads bytes at fixed points.

    * the first forward of each step (a forward pre-hook on the model the script will wrap): the
      step begins; the gradients still alive then (0 when the script frees them at the end of a step);
    * the end of that forward (a forward hook): the bytes it added, and the full parameters FSDP2
      still holds (``gathered_parameter_bytes``);
    * ``optimizer.step()`` returning (a global optimizer-step post-hook; with ZeRO-1 the outer
      optimizer's, after the broadcast): the bytes alive by category: parameters, gradients
      (before the script frees them), optimizer state, and the rest.
    The collective counter counts from a step's first forward to its optimizer step only.
    """

    def __init__(self, region: measure_memory, device: torch.device, counter: CollectiveCounter,
                 features: torch.Tensor, strategy: str) -> None:
        self.region, self.device, self.counter, self.strategy = region, device, counter, strategy
        self.row_index = {features[i].numpy().tobytes(): i for i in range(len(features))}
        self.model: nn.Module | None = None
        self.in_step = False
        self.began = 0.0
        self.steps = 0
        self.step_ms: list[float] = []
        self.grad_bytes_at_step_start: list[int] = []
        self.forward_added: list[int] = []
        self.gathered_after_forward: list[int] = []
        self.first_step_indices: list[list[int]] = []
        self.after_step: dict[str, Any] = {}
        self._forward_began = 0
        self._first_forward = False

    def attach(self, model: nn.Module) -> list:
        """Hook into ``model`` (before the script wraps it) and into every optimizer's step; returns the handles."""
        from torch.optim.optimizer import register_optimizer_step_post_hook

        self.model = model
        self.counter.counting = False                   # wrapping, loading, saving: not a step's communication
        return [model.register_forward_pre_hook(self._forward_pre), model.register_forward_hook(self._forward_post),
                register_optimizer_step_post_hook(self._step_post)]

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def _forward_pre(self, module: nn.Module, inputs: tuple) -> None:
        if not self.in_step:                            # the step's first forward: the step begins
            self._sync()
            self.in_step, self.began = True, time.perf_counter()
            self.counter.counting = True
            self.grad_bytes_at_step_start.append(local_bytes([p.grad for p in module.parameters()]))
            self._first_forward = True
        if self.steps == 0:                             # which samples the first step trained on, by their rows
            rows = inputs[0].detach().cpu()
            self.first_step_indices.append([self.row_index[row.numpy().tobytes()] for row in rows])
        self._forward_began = _live_bytes(self.region)

    def _forward_post(self, module: nn.Module, inputs: tuple, output: torch.Tensor) -> None:
        if self._first_forward:
            self.forward_added.append(_live_bytes(self.region) - self._forward_began)
            self.gathered_after_forward.append(gathered_parameter_bytes(module))
            self._first_forward = False

    def _step_post(self, optimizer: torch.optim.Optimizer, args: tuple, kwargs: dict) -> None:
        if not self.in_step or (self.strategy == "zero1" and not isinstance(optimizer, ZeroRedundancyOptimizer)):
            return                                      # ZeRO-1: its inner AdamW's step returns first; wait for ZeRO's
        self._sync()
        self.step_ms.append((time.perf_counter() - self.began) * 1e3)
        self.counter.counting = False
        self.in_step = False
        self.steps += 1
        params = list(self.model.parameters())
        local_optimizer = getattr(optimizer, "optim", optimizer)
        state = [v for s in local_optimizer.state.values() for v in s.values() if isinstance(v, torch.Tensor)]
        categories = {"params": local_bytes(params), "grads": local_bytes([p.grad for p in params]),
                      "optimizer": local_bytes(state)}
        live = _live_bytes(self.region)
        categories["other"] = live - sum(categories.values())
        owned = [p for group in local_optimizer.param_groups for p in group["params"]]
        sharded_state = [v for v in state if hasattr(v, "to_local")]
        self.after_step = {
            "after_step_bytes": live, "categories": categories, "zero_byte_storages": _zero_byte_storages(self.region),
            "owned_numel": sum(_local(p).numel() for p in owned), "owned_tensors": len(owned),
            "sharded_state_logical_bytes": sum(v.numel() * v.element_size() for v in sharded_state),
            "sharded_state_local_bytes": local_bytes(sharded_state),
        }


# --- one run: the script's own functions, measured -------------------------------------------------------------

def _script_namespace(args: argparse.Namespace, strategy: str, accumulation: int,
                      checkpoint_dir: Path | None, steps: int | None = None) -> argparse.Namespace:
    """The script's arguments for one run of a measured launch."""
    argv = ["--strategy", strategy, "--hidden", args.hidden, "--layers", args.layers, "--micro-batch", args.micro_batch,
            "--accumulation-steps", accumulation, "--steps", steps if steps is not None else args.steps,
            "--steps-per-epoch", args.steps_per_epoch, "--lr", args.lr, "--seed", args.seed,
            "--save-every", args.save_every, "--device", args.device, "--timeout-s", args.timeout_s]
    if checkpoint_dir is not None:
        argv += ["--checkpoint-dir", checkpoint_dir]
    return parse_args([str(a) for a in argv])


def run_one(script_args: argparse.Namespace, out: Path, *, device: torch.device, mesh: DeviceMesh,
            label: str) -> dict[str, Any]:
    """Run the script's ``train`` for one strategy on this rank (in an initialised process group), measured.

    The data set is made before the measured region (it is not model state); the region begins before the
    script builds its model, with the exact tracker on the CPU (watching storages that FSDP2 frees with
    ``resize_(0)``) or the CUDA allocator. Writes ``<out>/<label>_rank<r>.json`` and, on rank 0,
    ``<out>/<label>_weights.pt``; returns the record.
    """
    wall_start_s = time.time()   # wall clock, comparable with LaunchResult.started_at
    rank, world_size = dist.get_rank(), dist.get_world_size()
    samples = world_size * script_args.micro_batch * script_args.accumulation_steps * script_args.steps_per_epoch
    dataset = make_data(samples, script_args.hidden, script_args.seed + 1)
    counter = CollectiveCounter(world_size)
    hook_counter: dict[str, int] = {}
    region = measure_memory(device, timeline=False, **({"watch_resizes": True} if device.type == "cpu" else {}))
    handles: list = []
    with region as memory, counter:
        watcher = StepWatcher(region, device, counter, dataset.tensors[0], script_args.strategy)
        model, blocks = make_model(script_args.hidden, script_args.layers, script_args.seed)
        handles = watcher.attach(model)
        if script_args.strategy in ("ddp", "zero1"):         # count DDP's buckets: its reducer is not a dispatcher op
            original_ddp_init = DDP.__init__

            def counting_init(self, *a, **k):  # noqa: ANN001, ANN002, ANN003, ANN202
                original_ddp_init(self, *a, **k)
                self.register_comm_hook(None, make_counting_hook(hook_counter))
            DDP.__init__ = counting_init
        try:
            wrapped, losses = train(model, blocks, dataset, device, mesh, script_args)
        finally:
            if script_args.strategy in ("ddp", "zero1"):
                DDP.__init__ = original_ddp_init
            for handle in handles:
                handle.remove()
    steps_run = max(watcher.steps, 1)
    start_step = script_args.steps - watcher.steps
    every = script_args.save_every
    saved_before_last = script_args.checkpoint_dir is not None and every > 0 and any(
        start_step < saved < script_args.steps for saved in range(every, script_args.steps, every))
    params = list(wrapped.parameters())
    record = {
        "label": label, "strategy": script_args.strategy, "rank": rank, "world_size": world_size,
        "device": str(device), "backend": dist.get_backend(), "script_sha256": script_sha256(),
        "config": asdict(RunConfig(hidden=script_args.hidden, layers=script_args.layers,
                                   micro_batch=script_args.micro_batch,
                                   accumulation_steps=script_args.accumulation_steps, steps=script_args.steps,
                                   steps_per_epoch=script_args.steps_per_epoch, lr=script_args.lr,
                                   seed=script_args.seed)),
        "start_step": start_step, "num_parameters": sum(p.numel() for p in params), "num_tensors": len(params),
        "logical_param_bytes": sum(p.numel() * p.element_size() for p in params),
        # a checkpoint saved before the last step ran barriers: what the last of them left behind is "other"
        "barrier_retained_bytes": barrier_retained_bytes(device) if saved_before_last else 0,
        "peak_bytes": memory.peak_bytes, "end_bytes": memory.end_bytes, "losses": losses, "step_ms": watcher.step_ms,
        "grad_bytes_at_step_start": watcher.grad_bytes_at_step_start, "forward_added_bytes": watcher.forward_added,
        "gathered_after_forward_bytes": watcher.gathered_after_forward,
        "first_step_indices": watcher.first_step_indices, "wall_start_s": wall_start_s,
        "comm": {"hook_bucket_bytes_per_step": hook_counter.get("bytes", 0) / steps_run, "calls": counter.calls,
                 "payload_bytes": counter.payload_bytes, "ring_sent_bytes_per_step": counter.sent_bytes / steps_run},
        **watcher.after_step,
    }
    _write_results(wrapped, script_args.strategy, out, label, record)
    del wrapped, model
    dist.barrier()
    return record


def _full_state_dict(model: nn.Module, strategy: str) -> dict[str, torch.Tensor]:
    if strategy in ("ddp", "zero1"):
        return {k: v.detach().cpu().clone() for k, v in model.module.state_dict().items()}
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))   # a collective for FSDP
    return {k: v.detach().cpu().clone() for k, v in full.items()}


def _write_results(model: nn.Module, strategy: str, out: Path, label: str, record: dict[str, Any]) -> None:
    full = _full_state_dict(model, strategy)          # a collective for FSDP: every rank takes part
    record["weight_checksum"] = float(sum(v.double().sum() for v in full.values()))
    if record["rank"] == 0:
        torch.save(full, out / f"{label}_weights.pt")
    record["wall_end_s"] = time.time()
    (out / f"{label}_rank{record['rank']}.json").write_text(json.dumps(record, indent=1) + "\n")


def preempt_while_saving(script_args: argparse.Namespace, *, device: torch.device, mesh: DeviceMesh,
                         kill_rank: int) -> None:
    """A simulated preemption, injected from outside the script: restart the checkpointed run for one more step
    (the script resumes from its newest checkpoint) and make ``kill_rank`` exit (status ``KILLED_EXIT_CODE``) while
    it writes that step's checkpoint. The other ranks are left waiting in a collective until torchrun stops them."""
    from torch.distributed.checkpoint.filesystem import FileSystemWriter

    rank = dist.get_rank()
    last_step = script_args.steps
    original_write = FileSystemWriter.write_data

    def write_then_die(self, plan, planner):  # noqa: ANN001, ANN202
        if rank == kill_rank:
            Path(self.path, f"__{rank}_half_written.distcp").write_bytes(b"\0" * 64)
            print(f"rank {rank}: killed while writing checkpoint step {last_step} (simulated preemption)",
                  file=sys.stderr, flush=True)
            os._exit(KILLED_EXIT_CODE)
        return original_write(self, plan, planner)

    FileSystemWriter.write_data = write_then_die
    try:
        samples = dist.get_world_size() * script_args.micro_batch * script_args.steps_per_epoch
        model, blocks = make_model(script_args.hidden, script_args.layers, script_args.seed)
        train(model, blocks, make_data(samples, script_args.hidden, script_args.seed + 1), device, mesh, script_args)
    finally:
        FileSystemWriter.write_data = original_write


# --- the command line of a measured launch ----------------------------------------------------------------------

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
    """The command line of a measured launch: the script's arguments, several strategies, and ``--out``."""
    parser = argparse.ArgumentParser(prog="python -m utils.distributed --out DIR",
                                     description="the script's runs, measured per rank (under torchrun)")
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
    parser.add_argument("--checkpoint-dir", type=Path, default=None,
                        help=f"the {CHECKPOINT_STRATEGY!r} run checkpoints here (and resumes from it)")
    parser.add_argument("--save-every", type=int, default=0, help="steps between checkpoints (0: the last only)")
    parser.add_argument("--kill-rank", type=int, default=None,
                        help="after the checkpointed run, this rank dies saving one more step (simulated preemption)")
    parser.add_argument("--overwrite", action="store_true", help="replace results already in --out")
    return parser


def measured_main(argv: Sequence[str] | None = None) -> int:
    """Entry point of a measured launch (``python -m utils.distributed ... --out DIR`` under torchrun).

    Raises:
        RuntimeError: not started by torchrun (its variables are missing), or more ranks than
            GPUs with ``--device cuda``.
        ValueError: a world size the model cannot be split over, or inconsistent arguments.
    """
    args = build_parser().parse_args(argv)
    environment = require_torchrun_environment()
    return _run(args, int(environment["RANK"]), int(environment["WORLD_SIZE"]), int(environment["LOCAL_RANK"]))


def run_in_this_process(argv: Sequence[str]) -> int:
    """Run a measured launch as a one-rank job inside the calling process (no torchrun, no new process).

    N = 1 needs no launcher: this sets the variables torchrun would set (a free port on 127.0.0.1),
    runs exactly what ``measured_main`` runs, and restores them. ``--device`` is forced to the CPU.

    Raises:
        RuntimeError: a process group exists already in this process.
    """
    if dist.is_initialized():
        raise RuntimeError("a process group exists already in this process: expected none")
    args = build_parser().parse_args([*argv, "--device", "cpu"])
    saved = {name: os.environ.get(name) for name in TORCHRUN_VARIABLES}
    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(find_free_port()))
    try:
        return _run(args, 0, 1, 0)
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


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


def _run(args: argparse.Namespace, rank: int, world_size: int, local_rank: int) -> int:
    check_world_size(world_size, args.hidden)
    accumulation = args.accumulation_steps
    if len(accumulation) == 1:
        accumulation = accumulation * len(args.strategy)
    if len(accumulation) != len(args.strategy) or any(k < 1 for k in accumulation):
        raise ValueError(f"--accumulation-steps: expected 1 or {len(args.strategy)} positive values, "
                         f"got {accumulation}")
    if args.kill_rank is not None and args.checkpoint_dir is None:
        raise ValueError("--kill-rank needs --checkpoint-dir (the rank dies while writing a checkpoint)")
    labels = [s if k == 1 else f"{s}-accum{k}" for s, k in zip(args.strategy, accumulation)]
    if len(set(labels)) != len(labels):
        raise ValueError(f"each run needs its own strategy/accumulation pair, got {labels}")
    existing = [label for label in labels if (args.out / f"{label}_rank{rank}.json").exists()]
    if existing and not args.overwrite:
        raise FileExistsError(f"{args.out} holds results for {existing} already: expected a new folder, or --overwrite")
    args.out.mkdir(parents=True, exist_ok=True)
    device, mesh = start(world_size, local_rank, args.device, args.timeout_s)
    try:
        for strategy, k, label in zip(args.strategy, accumulation, labels):
            checkpointing = strategy == CHECKPOINT_STRATEGY and k == 1 and args.checkpoint_dir is not None
            script_args = _script_namespace(args, strategy, k, args.checkpoint_dir if checkpointing else None)
            run_one(script_args, args.out, device=device, mesh=mesh, label=label)
            if checkpointing and args.kill_rank is not None:
                dist.barrier()
                preempt_while_saving(_script_namespace(args, strategy, k, args.checkpoint_dir, steps=args.steps + 1),
                                     device=device, mesh=mesh, kill_rank=args.kill_rank)
    finally:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(measured_main() if "--out" in sys.argv else main())
