"""Model parallelism on CPU ranks: tensor, sequence, pipeline and context parallelism, predicted and measured.

Introduced in notebook 13 (model parallelism). Notebook 12 shards the model *state* over data-parallel
ranks; this module splits the *computation*: the width of each layer (tensor parallelism, ``tp``), the
sequence between the layers (sequence parallelism), the layers themselves (pipeline parallelism, ``pp``)
and the sequence inside attention (context parallelism, ``cp``). It holds:

* **The recipe** the notebook shows and this script runs (the notebook checks that its copy is this code):
  ``tensor_parallel_plan`` (the Megatron layout as a ``parallelize_module`` plan), ``reduce_partial_gradients``
  (the sequence-parallel norms' gradients all-reduced in one bucket before the optimizer step, as Megatron-LM
  does), ``shard_2d`` (FSDP2 over tensor parallelism on a 2-D mesh), ``make_pipeline_schedule`` and
  ``make_multi_stage_schedule`` (``torch.distributed.pipelining``, one or several stages per rank),
  ``ring_attention`` and ``all_gather_attention`` (context parallelism by hand: the ring, and Llama 3's
  all-gathered keys and values).
* **Instruments**: ``CollectiveLog`` records every collective a rank runs with its bytes (what ``CommDebugMode``
  counts, plus the sizes), ``SavedActivations`` the bytes autograd keeps for backward.
* **Predictions** the notebook derives by hand: per-rank bytes of the model state (``predict_model_state_bytes``),
  of one block's activations (``predict_block_activation_bytes``), the ring's key/value bytes and work per rank.
  The pipeline schedules' bubble and memory are read from their orders by ``utils.pipeline_schedules``; the
  calculator's ``utils.calculator.model_parallel`` combines the per-rank bytes for any model and layout, and
  ``utils.parallel_step_time`` models a layout's step time.
* **The launched script**: ``launch`` starts the ranks (gloo on the CPU) and reads each rank's JSON back: by
  default a fork server (one fresh Python imports torch once and forks the ranks, ``serve_ranks``), or one fresh
  Python per rank (``start="spawn"``); ``python -m utils.model_parallel --out DIR`` does the same from a shell,
  and under ``torchrun`` it runs as one rank (``python -m torch.distributed.run --standalone --nproc-per-node 4
  -m utils.model_parallel --out DIR``). Every argument the ranks depend on is checked before a process starts.

Known limitations: the ranks run on the CPU with gloo, so bytes and collectives are exact but no speed is
meaningful; the pipeline schedules need torch >= ``PIPELINING_ON_GLOO_FROM`` (earlier versions hang on gloo,
pytorch/pytorch#132644); a schedule this torch does not ship is skipped and named (``pipeline_schedules``).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import sys
import time
import weakref
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from . import pipeline_schedules
from .checks import positive_int
from .parallel import LaunchError, find_free_port

# torch.distributed.pipelining's _batch_p2p waited on one of gloo's several Work objects per batch and hung
# (pytorch/pytorch#132644); the fix (pull request #152938, May 2025) ships from torch 2.8 on
PIPELINING_ON_GLOO_FROM = (2, 8)
SCHEDULES = ("gpipe", "1f1b")                      # one stage per rank
MULTI_STAGE_SCHEDULES = pipeline_schedules.MULTI_STAGE   # several stages per rank (those this torch ships run)
MESH_DIMS = ("dp", "tp")


# --- the model every rank builds ------------------------------------------------------------------------------

class Attention(nn.Module):
    """Causal multi-head self-attention with separate q, k, v, o projections (no bias, as in Llama).

    The number of heads is read from the projection's output, so the same code runs on a tensor-parallel
    rank that holds ``heads / tp`` of them.
    """

    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.head_dim = width // heads
        self.q, self.k, self.v, self.o = (nn.Linear(width, width, bias=False) for _ in range(4))

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        q, k, v = (projection(h) for projection in (self.q, self.k, self.v))       # (B, L, heads·D) on this rank
        batch, seq = q.shape[:2]
        q, k, v = (t.view(batch, seq, -1, self.head_dim).transpose(1, 2) for t in (q, k, v))   # (B, H, L, D)
        attended = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o(attended.transpose(1, 2).reshape(batch, seq, -1))


class FeedForward(nn.Module):
    """The MLP: ``up`` (width -> ffn), GELU, ``down`` (ffn -> width), no bias."""

    def __init__(self, width: int, ffn: int) -> None:
        super().__init__()
        self.up = nn.Linear(width, ffn, bias=False)
        self.down = nn.Linear(ffn, width, bias=False)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return self.down(F.gelu(self.up(h)))


class Block(nn.Module):
    """A pre-norm transformer block: ``x + attention(norm(x))``, then ``x + mlp(norm(x))``."""

    def __init__(self, width: int, heads: int, ffn: int) -> None:
        super().__init__()
        self.attention_norm = nn.LayerNorm(width)
        self.attention = Attention(width, heads)
        self.mlp_norm = nn.LayerNorm(width)
        self.mlp = FeedForward(width, ffn)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(self.attention_norm(x))
        return x + self.mlp(self.mlp_norm(x))


class BlockStack(nn.Module):
    """``layers`` blocks in ``self.layers`` (a ModuleList): the model of sections 2 and 3."""

    def __init__(self, layers: int, width: int, heads: int, ffn: int) -> None:
        super().__init__()
        self.layers = nn.ModuleList(Block(width, heads, ffn) for _ in range(layers))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x


class LlamaAttention(nn.Module):
    """Attention with transformers' Llama names (``q_proj``, ``k_proj``, ``v_proj``, ``o_proj``), no rotary."""

    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.head_dim = width // heads
        self.q_proj, self.k_proj, self.v_proj, self.o_proj = (nn.Linear(width, width, bias=False) for _ in range(4))

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        q, k, v = (projection(h) for projection in (self.q_proj, self.k_proj, self.v_proj))
        batch, seq = q.shape[:2]
        q, k, v = (t.view(batch, seq, -1, self.head_dim).transpose(1, 2) for t in (q, k, v))
        attended = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o_proj(attended.transpose(1, 2).reshape(batch, seq, -1))


class LlamaMLP(nn.Module):
    """The gated (SwiGLU) MLP with transformers' names: ``down_proj(silu(gate_proj(h)) * up_proj(h))``."""

    def __init__(self, width: int, ffn: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(width, ffn, bias=False)
        self.up_proj = nn.Linear(width, ffn, bias=False)
        self.down_proj = nn.Linear(ffn, width, bias=False)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(h)) * self.up_proj(h))


class LlamaBlock(nn.Module):
    """A decoder layer shaped and named like transformers' ``LlamaDecoderLayer``: RMSNorm (a weight, no bias)
    before ``self_attn`` and before a gated ``mlp``. Notebook 13's exercise 1 splits it on fake ranks.

    Args:
        width, heads, ffn: the residual stream, attention heads, the MLP's hidden width.
    """

    def __init__(self, width: int, heads: int, ffn: int) -> None:
        super().__init__()
        self.input_layernorm = nn.RMSNorm(width)
        self.self_attn = LlamaAttention(width, heads)
        self.post_attention_layernorm = nn.RMSNorm(width)
        self.mlp = LlamaMLP(width, ffn)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x))
        return x + self.mlp(self.post_attention_layernorm(x))


@dataclass
class ModelParallelConfig:
    """What every rank builds and runs; the notebook's parameters cell fills it.

    Attributes:
        width, heads, ffn, layers: the blocks (``ffn`` the MLP's hidden width).
        batch, seq: the input of section 1 and 2 (one step), ``(batch, seq, width)``.
        vocab: the output head of ``loss_parallel``.
        mesh_layers: blocks of section 2's model (FSDP2, tensor parallelism and both on a 2-D mesh).
        micro_batches: the pipeline's micro-batches per step (the batch is ``micro_batches · batch``).
        chunks: stages per rank of the looped multi-stage schedules (interleaved 1F1B, interleaved zero bubble);
            the V schedules (ZBV, DualPipeV) always hold two.
        cp_seq: context parallelism's sequence length (split over all ranks).
        world_size: ranks (4: a 2 x 2 mesh for section 2).
        seed: every rank builds the same weights from it.
        collective_timeout_s: a collective that waits longer fails instead of hanging.
    """

    width: int = 32
    heads: int = 4
    ffn: int = 128
    layers: int = 8
    batch: int = 2
    seq: int = 16
    vocab: int = 64
    mesh_layers: int = 2
    micro_batches: int = 8
    chunks: int = 2
    cp_seq: int = 32
    world_size: int = 4
    seed: int = 0
    collective_timeout_s: float = 60.0


def make_block(config: ModelParallelConfig) -> Block:
    """The block of section 1 (same seed on every rank, so the same weights)."""
    torch.manual_seed(config.seed)
    return Block(config.width, config.heads, config.ffn)


def make_stack(config: ModelParallelConfig, layers: int | None = None) -> BlockStack:
    """The ``layers``-block model of section 3 (``config.layers``), or of section 2 (``config.mesh_layers``)."""
    torch.manual_seed(config.seed + 1)
    return BlockStack(layers or config.layers, config.width, config.heads, config.ffn)


def make_input(config: ModelParallelConfig, batch: int | None = None, seq: int | None = None,
               offset: int = 0) -> torch.Tensor:
    """A (batch, seq, width) input, the same on every rank."""
    generator = torch.Generator().manual_seed(config.seed + 100 + offset)
    return torch.randn(batch or config.batch, seq or config.seq, config.width, generator=generator)


# --- checks: everything a launch depends on, before a process starts -------------------------------------------

def check_mesh(world_size: int, shape: Sequence[int]) -> tuple[int, ...]:
    """``shape`` if its product is ``world_size``; a ValueError naming the sizes that would work otherwise."""
    positive_int("world_size", world_size)
    shape = tuple(shape)
    for size in shape:
        positive_int("each mesh dimension", size)
    if math.prod(shape) != world_size:
        options = [f"({a}, {world_size // a})" for a in range(1, world_size + 1) if world_size % a == 0]
        raise ValueError(f"a device mesh of shape {shape} needs {math.prod(shape)} ranks, not {world_size}: "
                         f"expected a shape whose sizes multiply to the world size, e.g. {', '.join(options)}")
    return shape


def check_tensor_parallel(width: int, heads: int, ffn: int, tp: int) -> None:
    """Tensor parallelism splits the heads and the MLP's hidden width evenly: a ValueError if ``tp`` does not."""
    positive_int("tp", tp)
    for name, size in (("width", width), ("heads", heads), ("ffn", ffn)):
        positive_int(name, size)
        if size % tp:
            raise ValueError(f"{name} = {size} is not divisible by the tensor-parallel degree tp = {tp}: expected a "
                             f"tp that divides the width ({width}), the heads ({heads}) and the MLP width ({ffn})")


def check_pipeline(layers: int, stages: int, micro_batches: int) -> None:
    """A pipeline needs one layer per stage or more, the same number on each, and (1F1B) ``micro_batches >= stages``."""
    positive_int("layers", layers)
    positive_int("stages", stages)
    positive_int("micro_batches", micro_batches)
    if stages > layers:
        raise ValueError(f"{stages} pipeline stages for {layers} layers: expected at most one stage per layer "
                         f"(stages <= {layers})")
    if layers % stages:
        raise ValueError(f"{layers} layers do not split evenly into {stages} stages: expected a number of stages "
                         f"that divides {layers}")
    if micro_batches < stages:
        raise ValueError(f"{micro_batches} micro-batches for {stages} stages: 1F1B expects at least as many "
                         f"micro-batches as stages (expected >= {stages})")


def check_multi_stage(layers: int, ranks: int, chunks: int, micro_batches: int) -> None:
    """The multi-stage schedules of section 3: ``ranks · chunks`` looped stages and ``2 · ranks`` V stages, each the
    same number of layers; DualPipeV wants at least as many micro-batches as stages, the looped schedules a
    multiple of their rounds (``max(1, m // ranks)``)."""
    positive_int("chunks", chunks)
    for stages in sorted({ranks * chunks, 2 * ranks}):
        if layers % stages:
            raise ValueError(f"{layers} layers do not split evenly into {stages} stages ({ranks} ranks x "
                             f"{stages // ranks} stages each): expected layers divisible by {stages}")
    if micro_batches < 2 * ranks:
        raise ValueError(f"{micro_batches} micro-batches for the V schedules' {2 * ranks} stages: DualPipeV expects "
                         f"at least as many micro-batches as stages (expected >= {2 * ranks})")
    rounds = max(1, micro_batches // ranks)
    if micro_batches % rounds:
        raise ValueError(f"{micro_batches} micro-batches over {ranks} ranks: the looped schedules run {rounds} rounds, "
                         f"expected a number of micro-batches divisible by {rounds}")


def check_context_parallel(seq: int, cp: int) -> None:
    """The load-balanced causal split cuts the sequence into ``2·cp`` equal chunks: a ValueError otherwise."""
    positive_int("seq", seq)
    positive_int("cp", cp)
    if seq % (2 * cp):
        raise ValueError(f"a sequence of {seq} tokens cannot be split over cp = {cp} ranks: expected a length "
                         f"divisible by 2·cp = {2 * cp} (two chunks per rank for the load-balanced causal split)")


def check_config(config: ModelParallelConfig) -> ModelParallelConfig:
    """Every check a launch needs, for the layouts the script runs: tp = world, a 2 x 2 mesh, pp = world (one and
    several stages per rank), cp = world."""
    world = config.world_size
    check_mesh(world, (2, world // 2))   # section 2's mesh: 2 data-parallel x world/2 tensor-parallel
    check_tensor_parallel(config.width, config.heads, config.ffn, world)
    check_tensor_parallel(config.width, config.heads, config.ffn, world // 2)
    if config.seq % world:
        raise ValueError(f"seq = {config.seq} is not divisible by tp = {world}: sequence parallelism splits the "
                         f"sequence between the blocks, so expected a multiple of {world}")
    positive_int("mesh_layers", config.mesh_layers)
    check_pipeline(config.layers, world, config.micro_batches)
    check_multi_stage(config.layers, world, config.chunks, config.micro_batches)
    check_context_parallel(config.cp_seq, world)
    if config.width % config.heads:
        raise ValueError(f"width {config.width} is not divisible by heads {config.heads}: expected whole heads")
    return config


# --- 1. the recipe: tensor and sequence parallelism --------------------------------------------------------------

def tensor_parallel_plan(sequence_parallel: bool = False) -> dict:
    """The Megatron layout of one block as a parallelize_module plan (module name -> how to split it)."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput, RowwiseParallel,
                                                   SequenceParallel)
    # between blocks the activations are whole on every rank, or (sequence parallel) split along the sequence
    between = Shard(1) if sequence_parallel else Replicate()
    plan = {
        # one all-gather (SP) or nothing (TP) turns the norm's output into the whole input of q, k and v
        "attention": PrepareModuleInput(input_layouts=(between,), desired_input_layouts=(Replicate(),)),
        "attention.q": ColwiseParallel(), "attention.k": ColwiseParallel(), "attention.v": ColwiseParallel(),
        "attention.o": RowwiseParallel(output_layouts=between),     # the all-reduce (TP) or reduce-scatter (SP)
        "mlp": PrepareModuleInput(input_layouts=(between,), desired_input_layouts=(Replicate(),)),
        "mlp.up": ColwiseParallel(),                                  # each rank: ffn / tp hidden units
        "mlp.down": RowwiseParallel(output_layouts=between),
    }
    if sequence_parallel:   # the norms work on 1/tp of the tokens each, outside the all-gather
        plan |= {"attention_norm": SequenceParallel(), "mlp_norm": SequenceParallel()}
    return plan


def reduce_partial_gradients(model: nn.Module) -> list[str]:
    """All-reduce, in one bucket, the gradients that backward left as partial sums (sequence parallelism's norms)."""
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor, Replicate
    partial = [(name, p) for name, p in model.named_parameters()
               if isinstance(p.grad, DTensor) and any(placement.is_partial() for placement in p.grad.placements)]
    if not partial:
        return []
    mesh = partial[0][1].grad.device_mesh          # one tensor-parallel group (a 1-D mesh)
    bucket = torch.cat([p.grad.to_local().flatten() for _, p in partial])   # one message instead of one per tensor
    dist.all_reduce(bucket, group=mesh.get_group())
    for (_, p), chunk in zip(partial, bucket.split([p.numel() for _, p in partial])):
        p.grad = DTensor.from_local(chunk.view(p.shape), mesh, [Replicate()], run_check=False)
    return [name for name, _ in partial]


def parallel_loss(head: nn.Linear, mesh: Any, hidden: torch.Tensor, labels: torch.Tensor) -> tuple:
    """Cross-entropy over logits split by the vocabulary: no rank ever holds all of them."""
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, loss_parallel, parallelize_module
    parallelize_module(head, mesh, ColwiseParallel(output_layouts=Shard(-1), use_local_output=False))
    logits = head(hidden)                      # a DTensor: (B, L, vocab / tp) on each rank
    with loss_parallel():                      # the softmax's max and sum are all-reduced, not the logits
        loss = F.cross_entropy(logits.flatten(0, 1), labels.flatten())
        loss.backward()
    return loss, logits


def shard_2d(model: nn.Module, mesh: Any) -> nn.Module:
    """FSDP2 over tensor parallelism: each block split over mesh["tp"], its shards sharded again over mesh["dp"]."""
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import parallelize_module
    for block in model.layers:
        parallelize_module(block, mesh["tp"], tensor_parallel_plan())   # within a node: fast links
        fully_shard(block, mesh=mesh["dp"])                            # across nodes: one all-gather per block
    fully_shard(model, mesh=mesh["dp"])
    return model


# --- 3. the recipe: pipeline parallelism --------------------------------------------------------------------------

def make_pipeline_schedule(stage_module: nn.Module, stage_index: int, num_stages: int, micro_batches: int,
                           loss_fn: Callable, schedule: str = "1f1b") -> Any:
    """One rank's pipeline stage and its schedule: GPipe (all forwards, then all backwards) or 1F1B."""
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe
    stage = PipelineStage(stage_module, stage_index, num_stages, torch.device("cpu"))
    schedule_class = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}[schedule]
    # the schedule cuts each batch into micro_batches along dim 0 and sends activations between the stages
    return schedule_class(stage, n_microbatches=micro_batches, loss_fn=loss_fn)


def make_multi_stage_schedule(stage_modules: dict[int, nn.Module], num_stages: int, micro_batches: int,
                              loss_fn: Callable, schedule_class: type) -> Any:
    """One rank's several stages ({stage index: module}) and a schedule that interleaves them (looped or V)."""
    from torch.distributed.pipelining import PipelineStage
    stages = [PipelineStage(module, index, num_stages, torch.device("cpu"))
              for index, module in sorted(stage_modules.items())]
    return schedule_class(stages, n_microbatches=micro_batches, loss_fn=loss_fn)


def pipeline_step(schedule: Any, stage_index: int | Sequence[int], num_stages: int, inputs: torch.Tensor,
                  targets: torch.Tensor) -> list[torch.Tensor]:
    """One training step: the rank with the first stage feeds the batch, the one with the last computes the losses."""
    held = {stage_index} if isinstance(stage_index, int) else set(stage_index)   # this rank's stages
    losses: list[torch.Tensor] = []
    feeds = (inputs,) if 0 in held else ()                             # a one-stage pipeline does both
    scores = {"target": targets, "losses": losses} if num_stages - 1 in held else {}
    schedule.step(*feeds, **scores)
    return losses          # one per micro-batch, on the rank with the last stage only


# --- 4. the recipe: context parallelism (ring attention, and Llama 3's all-gathered keys and values) -----------------

def ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_positions: torch.Tensor,
                   kv_positions: torch.Tensor, scale: float | None = None) -> tuple[torch.Tensor, int]:
    """Causal attention over every rank's keys, k/v chunks passed round the ring; k, v may have fewer heads than q."""
    import torch.distributed as dist
    rank, world, dtype = dist.get_rank(), dist.get_world_size(), q.dtype
    q = q.float().unflatten(1, (k.shape[1], -1)) * (q.shape[-1] ** -0.5 if scale is None else scale)   # G per k/v head
    running_max = torch.full(q.shape[:-1] + (1,), -math.inf, device=q.device)    # (B, Hkv, G, Lq, 1): notebook 11's
    running_sum, output, blocks = torch.zeros_like(running_max), 0.0, 0           # online softmax, in fp32
    for step in range(world):
        if step < world - 1:       # pass our chunk on (and receive the previous rank's) while we compute
            incoming = [torch.empty_like(t) for t in (k, v, kv_positions)]
            sends = [dist.P2POp(dist.isend, t, (rank + 1) % world) for t in (k, v, kv_positions)]
            requests = dist.batch_isend_irecv(sends + [dist.P2POp(dist.irecv, t, (rank - 1) % world) for t in incoming])
        allowed = kv_positions[None, :] <= q_positions[:, None]              # (Lq, Lk): no key after the query
        if allowed.any():          # a chunk wholly in the future is skipped; each k/v head serves its G query heads
            scores = (q @ k.float().unsqueeze(2).transpose(-2, -1)).masked_fill_(~allowed, -math.inf)
            new_max = torch.maximum(running_max, scores.amax(dim=-1, keepdim=True))
            rescale, weights = torch.exp(running_max - new_max), torch.exp(scores - new_max)
            running_sum = running_sum * rescale + weights.sum(dim=-1, keepdim=True)
            output, running_max, blocks = output * rescale + weights @ v.float().unsqueeze(2), new_max, blocks + 1
        if step < world - 1:
            for request in requests:
                request.wait()
            k, v, kv_positions = incoming
    return (output / running_sum).flatten(1, 2).to(dtype), blocks


def all_gather_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_positions: torch.Tensor,
                         kv_positions: torch.Tensor, scale: float | None = None) -> torch.Tensor:
    """Causal attention of this rank's queries over every rank's keys: gather all keys and values first (Llama 3)."""
    import torch.distributed as dist
    world = dist.get_world_size()
    gathered = []
    for t in (k, v, kv_positions):                   # one all-gather each; with few key/value heads they are small
        parts = [torch.empty_like(t) for _ in range(world)]
        dist.all_gather(parts, t.contiguous())
        gathered.append(torch.cat(parts, dim=-2 if t.dim() > 1 else 0))
    k_all, v_all, kv_all = gathered
    allowed = kv_all[None, :] <= q_positions[:, None]                       # (Lq, L): no key after the query
    return F.scaled_dot_product_attention(q, k_all, v_all, attn_mask=allowed, scale=scale,   # None: 1/√D
                                          enable_gqa=k.shape[1] != q.shape[1])      # fewer k/v heads than q's


def sequence_chunks(seq: int, cp: int, rank: int, balanced: bool) -> torch.Tensor:
    """The positions rank ``rank`` holds: one contiguous 1/cp, or (balanced) chunks ``rank`` and ``2cp-1-rank``."""
    if seq % (2 * cp):
        raise ValueError(f"a sequence of {seq} tokens cannot be split over cp = {cp} ranks: expected a length "
                         f"divisible by 2·cp = {2 * cp} (two chunks per rank for the load-balanced causal split)")
    if not balanced:
        size = seq // cp
        return torch.arange(rank * size, (rank + 1) * size)
    size = seq // (2 * cp)
    first, second = rank, 2 * cp - 1 - rank
    return torch.cat([torch.arange(first * size, (first + 1) * size), torch.arange(second * size, (second + 1) * size)])


# --- instruments -----------------------------------------------------------------------------------------------

# each collective's name as torch.distributed calls it, from the aten operators it dispatches to: the functional
# collectives DTensor runs (_c10d_functional) and the process group's own (c10d: dist.all_reduce, isend, ...)
COLLECTIVE_NAMES = {"all_reduce": "all_reduce", "allreduce_": "all_reduce", "all_reduce_coalesced": "all_reduce",
                    "allreduce_coalesced_": "all_reduce", "all_gather_into_tensor": "all_gather",
                    "_allgather_base_": "all_gather", "allgather_": "all_gather",
                    "allgather_into_tensor_coalesced_": "all_gather", "all_gather_into_tensor_coalesced": "all_gather",
                    "reduce_scatter_tensor": "reduce_scatter", "_reduce_scatter_base_": "reduce_scatter",
                    "reduce_scatter_": "reduce_scatter", "reduce_scatter_tensor_coalesced": "reduce_scatter",
                    "reduce_scatter_tensor_coalesced_": "reduce_scatter", "all_to_all_single": "all_to_all",
                    "alltoall_base_": "all_to_all", "alltoall_": "all_to_all", "broadcast": "broadcast",
                    "broadcast_": "broadcast", "send": "send", "recv_": "recv", "recv_any_source_": "recv"}
_COLLECTIVE_NAMESPACES = ("_c10d_functional", "c10d_functional", "c10d")
# the c10d operators write into their first argument and read their second; the functional ones return the result
_OUT_IN = {"_allgather_base_", "allgather_", "allgather_into_tensor_coalesced_", "_reduce_scatter_base_",
           "reduce_scatter_", "reduce_scatter_tensor_coalesced_", "alltoall_base_", "alltoall_"}


def _tensor_bytes(obj: Any) -> int:
    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size()
    if isinstance(obj, (list, tuple)):
        return sum(_tensor_bytes(item) for item in obj)
    return 0


class CollectiveLog(TorchDispatchMode):
    """Records every collective this rank runs, with its bytes: what ``CommDebugMode`` counts, plus the sizes.

    Inside ``with CollectiveLog() as log:``, each collective (a DTensor redistribution, ``dist.all_reduce``, a ring's
    ``isend``/``irecv``) is one ``log.records`` entry ``{"phase", "op", "in_bytes", "out_bytes"}``: the bytes this
    rank puts in (its shard, its partial sum) and gets back. ``log.phase("backward")`` labels what follows, so one
    window covers a whole training step. DTensor operations are let through first (``NotImplemented``), so the
    log sees the collectives they turn into, as ``CommDebugMode`` does.

    Args:
        phase: the label of the first records.

    Example:
        >>> with CollectiveLog() as log:                       # doctest: +SKIP
        ...     out = block(x); log.phase("backward"); out.sum().backward()
        >>> log.counts()                                       # doctest: +SKIP
        {('forward', 'all_gather'): 2, ('forward', 'reduce_scatter'): 2, ...}

    Known limitations: bytes are the tensors' sizes on this rank, not what a ring algorithm sends on the wire
    (a ring all-reduce sends ``2 (N - 1) / N`` of them, an all-gather ``(N - 1) / N`` of its output).
    Introduced in notebook 13.
    """

    def __init__(self, phase: str = "forward") -> None:
        super().__init__()
        self.current, self.records = phase, []

    def phase(self, name: str) -> None:
        """Label the collectives that follow (e.g. ``"backward"``, ``"optimizer"``)."""
        self.current = name

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
        dtensor = sys.modules.get("torch.distributed.tensor")
        if dtensor is not None and any(issubclass(t, dtensor.DTensor) for t in types):
            return NotImplemented                        # let DTensor run first and turn into plain collectives
        out = func(*args, **(kwargs or {}))
        name = getattr(func, "_overloadpacket", func).__name__ if hasattr(func, "namespace") else ""
        if getattr(func, "namespace", None) in _COLLECTIVE_NAMESPACES and name in COLLECTIVE_NAMES:
            if name in _OUT_IN:
                sent, received = _tensor_bytes(args[1]), _tensor_bytes(args[0])
            elif name.startswith("recv"):
                sent, received = 0, _tensor_bytes(args[0])
            elif name == "send":
                sent, received = _tensor_bytes(args[0]), 0
            elif func.namespace == "c10d":                # in place: all_reduce_, broadcast_
                sent = received = _tensor_bytes(args[0])
            else:
                sent, received = _tensor_bytes(args[0]), _tensor_bytes(out)
            self.records.append({"phase": self.current, "op": COLLECTIVE_NAMES[name], "in_bytes": sent,
                                 "out_bytes": received})
        return out

    def counts(self) -> dict[tuple[str, str], int]:
        """``{(phase, op): count}``."""
        counted: dict[tuple[str, str], int] = {}
        for record in self.records:
            key = (record["phase"], record["op"])
            counted[key] = counted.get(key, 0) + 1
        return counted


def plan_signature(plan: dict) -> tuple | None:
    """A plan as plain data (module name, style, its settings), equal for equal plans; None if a setting has no
    stable form (then nothing is cached). Introduced in notebook 13 (exercise 1's cache).

    Example:
        >>> plan_signature(tensor_parallel_plan()) == plan_signature(tensor_parallel_plan())
        True
    """
    described = []
    for name, style in sorted(plan.items()):
        settings = repr(sorted(vars(style).items()))
        if " at 0x" in settings:
            return None
        described.append((name, type(style).__name__, settings))
    return tuple(described)


def log_training_step(block: nn.Module, plan: dict, tp: int, batch: int, seq: int, *, bucketed: bool = False,
                      foreach: bool = False, seed: int = 0, cache: dict | None = None
                      ) -> tuple[CollectiveLog, Any, nn.Module]:
    """One training step of ``block`` split by ``plan`` on rank 0 of ``tp`` *fake* ranks, in this process.

    ``torch.distributed``'s ``fake`` backend returns every collective at once without data: shapes, placements
    and the collectives DTensor runs (with their sizes) are real, values are not. The input is rank 0's slice of a
    ``(batch, seq, width)`` sequence as ``Shard(1)`` cuts it (``ceil(seq / tp)`` tokens: an uneven split gives the
    last ranks fewer); the step is forward, backward of the sum of squares, optionally ``reduce_partial_gradients``,
    and one ``AdamW`` step (``foreach=False`` unless asked), each phase labelled in the log.

    Args:
        block: a module (``LlamaBlock``, ``Block``); ``width`` is read from its first vector parameter (a norm's).
        plan: its ``parallelize_module`` plan.
        tp: ranks (2 or more).
        batch, seq: the whole input's sequences and tokens.
        bucketed: all-reduce the partial gradients in one bucket before the step.
        foreach: AdamW's ``foreach`` path instead of its for-loop.
        seed: the input's.
        cache: a dict that keeps each step's result by (plan, block's shapes, sizes): the same step asked again
            (a graded cell run twice) is not run again; the block returned is then the first one split.

    Returns:
        ``(log, output, block)``: the ``CollectiveLog`` (phases ``forward``, ``backward``, ``bucketed reduce``,
        ``optimizer``), rank 0's output, and the split block.

    Raises:
        RuntimeError: a process group is already initialised in this process.

    Example:
        >>> log, out, _ = log_training_step(make_block(ModelParallelConfig()), tensor_parallel_plan(True), 4, 2, 16)
        >>> log.counts()[("forward", "all_gather")], tuple(out.shape)
        (2, (2, 4, 32))

    Introduced in notebook 13.
    """
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import parallelize_module
    from torch.testing._internal.distributed.fake_pg import FakeStore
    signature = plan_signature(plan)
    key = (signature, type(block).__name__, tuple((n, tuple(p.shape)) for n, p in block.named_parameters()), tp, batch,
           seq, bucketed, foreach, seed)
    if cache is not None and signature is not None and key in cache:
        return cache[key]
    if dist.is_initialized():
        raise RuntimeError("log_training_step starts a fake process group of its own: expected none initialised")
    width = next(p.shape[0] for p in block.parameters() if p.dim() == 1)
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=tp)
    try:
        parallelize_module(block, init_device_mesh("cpu", (tp,)), plan)
        optimizer = torch.optim.AdamW(block.parameters(), lr=1e-3, foreach=foreach)
        rows = math.ceil(seq / tp)                                       # rank 0's share of the sequence
        x = torch.randn(batch, rows, width, generator=torch.Generator().manual_seed(seed), requires_grad=True)
        with CollectiveLog("forward") as log:
            out = block(x)
            log.phase("backward")
            _local(out).square().sum().backward()
            if bucketed:
                log.phase("bucketed reduce")
                reduce_partial_gradients(block)
            log.phase("optimizer")
            optimizer.step()
    finally:
        dist.destroy_process_group()
    if cache is not None and signature is not None:
        cache[key] = (log, out, block)
    return log, out, block


# the graded cells' cache: a wrong answer and the solution run the same split steps again (notebook 13, exercise 1)
STEP_LOGS: dict = {}


class SavedActivations:
    """Counts the bytes autograd keeps for backward, live, on this rank (local shards of DTensors).

    A pack hook wraps each saved tensor's storage in a holder; a finalizer subtracts its bytes when autograd
    drops the holder (after the backward that used it). Parameters (and their shards) are not counted.
    ``live`` is the count now, ``peak`` the highest so far.
    """

    def __init__(self, exclude: nn.Module | Sequence[nn.Module] | None = None,
                 also: Sequence[torch.Tensor] = ()) -> None:
        modules = [] if exclude is None else [exclude] if isinstance(exclude, nn.Module) else list(exclude)
        tensors = [*(p for module in modules for p in module.parameters()), *also]   # also: e.g. the whole batch
        self.excluded = {_local(t).untyped_storage().data_ptr() for t in tensors}
        self.live, self.peak, self._counts = 0, 0, {}

    def _pack(self, tensor: torch.Tensor) -> Any:
        storage = _local(tensor).untyped_storage()
        key = storage.data_ptr()
        # detached: a saved *output* kept with its grad_fn would point back at the node that saves it, a cycle
        # through C++ that Python's garbage collector cannot break (it leaks wherever backward leaves the node
        # alive: the zero-bubble schedules' input backward retains the graph)
        holder = _Holder(tensor.detach())
        if key not in self.excluded:
            if self._counts.get(key, 0) == 0:
                self.live += storage.nbytes()
                self.peak = max(self.peak, self.live)
            self._counts[key] = self._counts.get(key, 0) + 1
            weakref.finalize(holder, self._release, key, storage.nbytes())
        return holder

    def _release(self, key: int, nbytes: int) -> None:
        self._counts[key] -= 1
        if self._counts[key] == 0:
            self.live -= nbytes

    def hooks(self) -> Any:
        """The ``saved_tensors_hooks`` context that counts."""
        return torch.autograd.graph.saved_tensors_hooks(self._pack, lambda holder: holder.tensor)


class _Holder:
    __slots__ = ("tensor", "__weakref__")

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor = tensor


def _local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor


def local_bytes(tensors: Any) -> int:
    """Bytes of the distinct local storages behind tensors (DTensors count their shard on this rank)."""
    seen: dict[int, int] = {}
    for tensor in tensors:
        if tensor is None:
            continue
        storage = _local(tensor).untyped_storage()
        seen[storage.data_ptr()] = storage.nbytes()
    return sum(seen.values())


def model_state_bytes(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, int]:
    """This rank's bytes of parameters, gradients and optimizer state, read from the tensors themselves."""
    parameters = list(model.parameters())
    state = [v for s in optimizer.state.values() for v in s.values() if isinstance(v, torch.Tensor)]
    return {"parameters": local_bytes(parameters), "gradients": local_bytes(p.grad for p in parameters),
            "optimizer": local_bytes(state)}


# --- predictions --------------------------------------------------------------------------------------------------

def block_parameter_split(width: int, ffn: int) -> tuple[int, int, int]:
    """Elements of one ``Block`` that tensor parallelism splits (q, k, v, o, up, down), that it replicates (the two
    LayerNorms' weight and bias), and the number of parameter tensors."""
    return 4 * width * width + 2 * width * ffn, 4 * width, 10


def predict_model_state_bytes(sharded: int, replicated: int, num_tensors: int, *, tp: int = 1, dp: int = 1,
                              pp: int = 1, zero: int = 3, bytes_per_parameter: int = 16,
                              counter_bytes: int = 4) -> int:
    """Bytes of model state (weights, gradients, optimizer state) one rank holds.

    ``sharded`` elements are split by tensor parallelism (1/tp), ``replicated`` ones are not; pipeline
    parallelism gives each rank 1/pp of the layers; with ZeRO-3 / FSDP (``zero=3``) the data-parallel
    ranks split the rest again (1/dp), with ``zero=0`` (DDP) they do not, with ``zero=1`` only the
    optimizer state (and master weights) is split.

    Args:
        sharded, replicated: parameter elements of the whole model by kind.
        num_tensors: parameter tensors of the whole model (Adam's 4-byte step counter each; FSDP and TP keep
            one per tensor on every rank; a pipeline stage holds 1/pp of them).
        tp, dp, pp: degrees.
        zero: 0, 1 or 3.
        bytes_per_parameter: 16 for AdamW in fp32 (4 weight + 4 gradient + 8 moments) or in mixed precision
            (2 + 2 + 4 master + 8).
        counter_bytes: per tensor (4 for Adam's step; 0 to leave it out).

    Returns:
        Bytes per rank (the division rounds up: a shard is never smaller than 1/N).
    """
    for name, value in (("tp", tp), ("dp", dp), ("pp", pp)):
        positive_int(name, value)
    if zero not in (0, 1, 3):
        raise ValueError(f"zero must be 0 (DDP), 1 (optimizer state sharded) or 3 (FSDP), got {zero!r}")
    elements = sharded / (tp * pp) + replicated / pp
    if zero == 3:
        per_rank = elements * bytes_per_parameter / dp
    elif zero == 1:
        weights_and_grads = 4 if bytes_per_parameter == 16 else bytes_per_parameter // 2
        per_rank = elements * (weights_and_grads + (bytes_per_parameter - weights_and_grads) / dp)
    else:
        per_rank = elements * bytes_per_parameter
    return math.ceil(per_rank) + counter_bytes * math.ceil(num_tensors / pp)


def predict_block_activation_bytes(batch: int, seq: int, width: int, heads: int, ffn: int, *, tp: int = 1,
                                   sequence_parallel: bool = False, element_bytes: int = 4) -> dict[str, int]:
    """Bytes one ``Block`` keeps for backward on one tensor-parallel rank, by where they live.

    In one process the block keeps (B = batch, L = seq, C = width, F = ffn, H = heads): its input x and the
    mid-block residual (the norms' inputs, B·L·C each), both norms' outputs (the q/k/v and up projections'
    input, B·L·C each), the norms' mean and reciprocal std (2·B·L each); q, k, v and the attention output
    (B·L·C each: the output is o's input too), the fused kernel's log-sum-exp (B·H·L, fp32), the MLP's
    hidden layer before and after GELU (B·L·F each).

    Tensor parallelism splits heads and F: q, k, v, the attention output, the log-sum-exp and the two
    hidden layers are 1/tp per rank ("sharded"); the rest is whole on every rank ("replicated").
    Sequence parallelism also splits x, the residual and the norms' statistics along the sequence (1/tp),
    but the norms' outputs are all-gathered before q, k, v and up use them, and those whole tensors are
    what the projections keep ("gathered"): DTensor keeps the gathered input, Megatron-LM keeps its shard
    and gathers it again in backward.

    Returns:
        ``{"replicated": ..., "sharded": ..., "seq_sharded": ..., "gathered": ..., "total": ...}`` bytes.
    """
    check_tensor_parallel(width, heads, ffn, tp)
    b, s, c, f, h, e = batch, seq, width, ffn, heads, element_bytes
    sharded = (4 * b * s * c * e + b * h * s * 4 + 2 * b * s * f * e) // tp
    stream = 2 * b * s * c * e + 2 * 2 * b * s * 4          # x, residual, two norms' mean and rstd (fp32)
    norm_outputs = 2 * b * s * c * e
    if sequence_parallel:
        parts = {"replicated": 0, "sharded": sharded, "seq_sharded": stream // tp, "gathered": norm_outputs}
    else:
        parts = {"replicated": stream + norm_outputs, "sharded": sharded, "seq_sharded": 0, "gathered": 0}
    return parts | {"total": sum(parts.values())}


def bubble_fraction(stages: int, micro_batches: int) -> float:
    """GPipe's and 1F1B's idle share of the step, ``(p - 1) / (m + p - 1)``, whatever backward costs against
    forward (Narayanan et al. and the Ultra-Scale Playbook quote ``(p - 1) / m``: idle time over ideal time)."""
    return pipeline_schedules.one_f_one_b_bubble(stages, micro_batches)


def gpipe_in_flight(stage: int, stages: int, micro_batches: int) -> int:
    """Micro-batches whose activations a GPipe stage holds at its peak: all of them (every forward comes first)."""
    positive_int("stages", stages)
    if not 0 <= stage < stages:
        raise ValueError(f"stage must be in 0..{stages - 1}, got {stage!r}")
    return micro_batches


def ring_blocks_per_rank(seq: int, cp: int, balanced: bool) -> list[int]:
    """Key/value chunks each rank's queries attend to in a causal ring (a chunk wholly in the future is skipped)."""
    check_context_parallel(seq, cp)
    counts = []
    for rank in range(cp):
        queries = sequence_chunks(seq, cp, rank, balanced)
        counts.append(sum(bool((sequence_chunks(seq, cp, other, balanced)[None, :] <= queries[:, None]).any())
                          for other in range(cp)))
    return counts


def ring_work_per_rank(seq: int, cp: int, balanced: bool) -> list[int]:
    """Query-key pairs each rank computes in a causal ring (the triangle's share of each rank)."""
    check_context_parallel(seq, cp)
    return [int((torch.arange(seq)[None, :] <= sequence_chunks(seq, cp, r, balanced)[:, None]).sum())
            for r in range(cp)]


# --- the parts each rank runs ----------------------------------------------------------------------------------

def _max_difference(mine: torch.Tensor, reference: torch.Tensor) -> float:
    """Largest difference between a rank's tensor and one process's: a shard against the same slice, a partial sum
    made whole first (a collective), a replica or a plain tensor as it is."""
    if not hasattr(mine, "placements"):
        return (mine.detach() - reference).abs().max().item()
    placement = mine.placements[0]                                   # a 1-D tensor-parallel mesh
    if placement.is_partial():
        return (mine.full_tensor().detach() - reference).abs().max().item()
    if placement.is_shard():
        reference = reference.chunk(mine.device_mesh.size(), placement.dim)[mine.device_mesh.get_local_rank()]
    return (mine.to_local().detach() - reference).abs().max().item()


# the steps of section 1: the plain plan, sequence parallelism, and sequence parallelism with the bucketed reduce
TP_STEPS = {"tp": (False, False), "sp": (True, False), "sp_bucketed": (True, True)}


def _tensor_parallel_part(config: ModelParallelConfig, rank: int, world: int) -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.parallel import parallelize_module
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
    reference = make_block(config)                       # one process: the whole block, the whole input
    x = make_input(config).requires_grad_()
    reference_out = reference(x)
    reference_out.square().mean().backward()
    reference_grads = {name: p.grad.clone() for name, p in reference.named_parameters()}
    torch.optim.AdamW(reference.parameters(), lr=1e-3, foreach=False).step()
    reference_weights = {name: p.detach().clone() for name, p in reference.named_parameters()}
    record: dict[str, Any] = {}
    for name, (sp, bucketed) in TP_STEPS.items():
        block = make_block(config)
        parallelize_module(block, mesh, tensor_parallel_plan(sequence_parallel=sp))
        optimizer = torch.optim.AdamW(block.parameters(), lr=1e-3, foreach=False)
        rows = slice(rank * config.seq // world, (rank + 1) * config.seq // world) if sp else slice(None)
        local_x = x.detach()[:, rows].clone().requires_grad_()      # SP: this rank's slice of the sequence
        saved = SavedActivations(exclude=block)
        with CollectiveLog("forward") as log:                # one window: the whole training step
            with saved.hooks():
                out = block(local_x)
            activation_bytes = saved.live
            log.phase("backward")
            # the mean over the whole output: SP ranks hold 1/tp of it, so scale to the same loss
            (out.square().sum() / reference_out.numel()).backward()
            partial = [n for n, p in block.named_parameters()
                       if isinstance(p.grad, DTensor) and any(pl.is_partial() for pl in p.grad.placements)]
            if bucketed:
                log.phase("bucketed reduce")
                reduce_partial_gradients(block)
            log.phase("optimizer")
            optimizer.step()
        record[name] = {
            "max_output_error": (out.detach() - reference_out.detach()[:, rows]).abs().max().item(),
            "max_input_grad_error": (local_x.grad - x.grad[:, rows]).abs().max().item(),
            # outside the log: making a shard or a partial sum whole is itself a collective
            "max_weight_grad_error": {n: _max_difference(p.grad, reference_grads[n])
                                      for n, p in block.named_parameters()},
            "max_weight_error_after_step": {n: _max_difference(p, reference_weights[n])
                                            for n, p in block.named_parameters()},
            "partial_gradients": partial, "collectives": log.records,
            "activation_bytes": activation_bytes, "state_bytes": model_state_bytes(block, optimizer),
            "output_shape": list(out.shape),
            "local_parameter_shapes": {n: list(_local(p).shape) for n, p in block.named_parameters()},
        }
    record["loss_parallel"] = _loss_parallel_part(config, mesh)
    return record


def _loss_parallel_part(config: ModelParallelConfig, mesh: Any) -> dict:
    torch.manual_seed(config.seed + 2)
    head = nn.Linear(config.width, config.vocab, bias=False)
    reference = nn.Linear(config.width, config.vocab, bias=False)
    reference.load_state_dict(head.state_dict())
    hidden = make_input(config, offset=1)
    labels = torch.randint(0, config.vocab, (config.batch, config.seq), generator=torch.Generator().manual_seed(3))
    loss, logits = parallel_loss(head, mesh, hidden, labels)
    reference_loss = F.cross_entropy(reference(hidden).flatten(0, 1), labels.flatten())
    reference_loss.backward()
    return {"loss_error": abs(loss.full_tensor().item() - reference_loss.item()),
            "weight_grad_error": (head.weight.grad.full_tensor() - reference.weight.grad).abs().max().item(),
            "local_logits_bytes": _local(logits).untyped_storage().nbytes(),
            "full_logits_bytes": config.batch * config.seq * config.vocab * 4}


def _two_d_part(config: ModelParallelConfig, rank: int, world: int) -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import parallelize_module

    from .memory import measure_memory
    x = make_input(config, offset=2)
    reference = make_stack(config, config.mesh_layers)
    reference_loss = reference(x).square().mean()
    record = {}
    shapes = {"fsdp": ((world,), ("dp",)), "tp": ((world,), ("tp",)), "fsdp+tp": ((2, world // 2), MESH_DIMS)}
    meshes = {layout: init_device_mesh("cpu", shape, mesh_dim_names=names)     # built outside the measured region
              for layout, (shape, names) in shapes.items()}
    for layout, mesh in meshes.items():
        model = make_stack(config, config.mesh_layers)
        if layout == "fsdp":
            for block in model.layers:
                fully_shard(block, mesh=mesh)
            fully_shard(model, mesh=mesh)
        elif layout == "tp":
            for block in model.layers:
                parallelize_module(block, mesh, tensor_parallel_plan())
        else:
            shard_2d(model, mesh)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=False)
        # on the 2-D mesh, the exact tracker follows every storage the step allocates and frees (FSDP2 frees the
        # layers it gathered by resizing their storage): a step leaves its gradients and AdamW's state, nothing else
        tracker = measure_memory("cpu", timeline=False, watch_resizes=True) if layout == "fsdp+tp" else None
        with tracker or contextlib.nullcontext() as memory:
            loss = model(x).square().mean()
            loss.backward()
            optimizer.step()
            loss = loss.item()
        record[layout] = {"state_bytes": model_state_bytes(model, optimizer),
                          "loss_error": abs(loss - reference_loss.item())}
        if memory is not None:
            record[layout]["step_left_bytes"] = memory.end_bytes
    return record


def _stage_modules(stack: BlockStack, indices: Sequence[int], num_stages: int) -> dict[int, nn.Module]:
    """Fresh copies of this rank's stages of ``stack`` (each schedule trains its own)."""
    import copy
    per_stage = len(stack.layers) // num_stages
    return {s: copy.deepcopy(nn.Sequential(*stack.layers[s * per_stage:(s + 1) * per_stage])) for s in indices}


def _instrument(stages: Sequence[Any], order: list, trace: list, counter: SavedActivations) -> None:
    """Log each forward, backward, input backward and weight backward a schedule runs on these stages, count what
    autograd saves inside it, and log the bytes kept just before it (what the previous action left, its loss
    included). Only the actions (and the loss) are counted: the first step's shape inference is not a micro-batch."""
    for stage in stages:
        forward, backward, weight = stage.forward_one_chunk, stage.backward_one_chunk, stage.backward_weight_one_chunk

        def logged(kind: str, run: Callable, stage_index: int) -> Callable:
            def action(micro, *args, **kwargs):
                trace.append(counter.live)
                # backward_one_chunk(chunk, loss=None, full_backward=True, ...): False is the input-only backward
                full = kwargs.get("full_backward", args[1] if len(args) > 1 else True)
                order.append(("B" if full else "I", stage_index, micro) if kind == "B" else (kind, stage_index, micro))
                with counter.hooks():
                    return run(micro, *args, **kwargs)
            return action

        stage.forward_one_chunk = logged("F", forward, stage.stage_index)
        stage.backward_one_chunk = logged("B", backward, stage.stage_index)
        stage.backward_weight_one_chunk = logged("W", weight, stage.stage_index)


def _pipeline_part(config: ModelParallelConfig, rank: int, world: int) -> dict:
    batch = config.micro_batches * config.batch
    inputs, targets = make_input(config, batch=batch, offset=3), make_input(config, batch=batch, offset=4)
    reference_stack = make_stack(config)
    reference = make_stack(config)
    F.mse_loss(reference(inputs), targets).backward()          # one process: the whole model, the whole batch
    reference_grads = [p.grad for p in reference.parameters()]
    per_layer = len(reference_grads) // config.layers
    available = pipeline_schedules.available_schedules()
    record: dict[str, Any] = {"missing": sorted(name for name, cls in available.items() if cls is None)}
    for name, cls in available.items():
        if cls is None:
            continue                                           # this torch does not ship it: named in "missing"
        chunks = pipeline_schedules.stages_per_rank(name) or config.chunks
        num_stages = world * chunks
        indices = pipeline_schedules.stage_indices(name, rank, world, chunks)
        modules = _stage_modules(reference_stack, indices, num_stages)
        counter = SavedActivations(exclude=list(modules.values()), also=[inputs, targets])  # the batch is there anyway

        def loss_fn(output: torch.Tensor, target: torch.Tensor, _counter: SavedActivations = counter) -> torch.Tensor:
            with _counter.hooks():                             # the last stage keeps the loss's input too
                return F.mse_loss(output, target)

        if name in SCHEDULES:
            schedule = make_pipeline_schedule(modules[rank], rank, num_stages, config.micro_batches, loss_fn, name)
            stages = [schedule._stage]
        else:
            schedule = make_multi_stage_schedule(modules, num_stages, config.micro_batches, loss_fn, cls)
            stages = schedule._stages
        order: list = []
        trace: list = []
        _instrument(stages, order, trace, counter)
        losses = pipeline_step(schedule, indices, num_stages, inputs, targets)   # one step, its first
        trace = trace[1:] + [counter.live]           # the bytes held after each action, its loss included
        per_stage = config.layers // num_stages
        grad_error = max((p.grad - reference_grads[s * per_stage * per_layer + i]).abs().max().item()
                         for s, module in modules.items() for i, p in enumerate(module.parameters()))
        after_forward, after_input = {}, {}
        for (kind, stage, micro), before, after in zip(order, [0] + trace[:-1], trace):
            if micro == 0 and kind == "F":
                after_forward[stage] = after - before
            if kind == "I" and stage not in after_input:       # DualPipeV splits the backward of some only
                after_input[stage] = after_forward[stage] + after - before
        record[name] = {"order": order, "held_after_each_action": trace, "held_after_step": counter.live,
                        "peak_saved_bytes": counter.peak, "after_forward": after_forward,
                        "after_input_backward": after_input, "max_grad_error": grad_error,
                        "losses": [loss.item() for loss in losses], "stages": indices, "chunks": chunks,
                        "micro_batches": config.micro_batches,
                        "parameter_bytes": local_bytes(p for module in modules.values() for p in module.parameters())}
        if name in SCHEDULES:     # one micro-batch's bytes on this rank's stage: what its first forward added
            record[name]["one_micro_batch_bytes"] = after_forward[rank]
    return record


def _context_parallel_part(config: ModelParallelConfig, rank: int, world: int) -> dict:
    heads, head_dim, seq = config.heads, config.width // config.heads, config.cp_seq
    generator = torch.Generator().manual_seed(config.seed + 5)
    q, k, v = (torch.randn(config.batch, heads, seq, head_dim, generator=generator) for _ in range(3))
    reference = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    record: dict[str, Any] = {"full_kv_bytes": 2 * k.untyped_storage().nbytes()}
    for balanced in (False, True):
        positions = sequence_chunks(seq, world, rank, balanced)
        local_q, local_k, local_v = (t[:, :, positions].contiguous() for t in (q, k, v))
        with CollectiveLog("ring") as log:
            out, blocks = ring_attention(local_q, local_k, local_v, positions, positions.clone())
        record["balanced" if balanced else "contiguous"] = {
            "max_error": (out - reference[:, :, positions]).abs().max().item(), "blocks": blocks,
            "local_kv_bytes": local_bytes([local_k, local_v]), "collectives": log.records}
    positions = sequence_chunks(seq, world, rank, True)
    local_q, local_k, local_v = (t[:, :, positions].contiguous() for t in (q, k, v))
    with CollectiveLog("all-gather") as log:
        out = all_gather_attention(local_q, local_k, local_v, positions, positions.clone())
    record["all_gather"] = {"max_error": (out - reference[:, :, positions]).abs().max().item(),
                            "collectives": log.records}
    # a reader's attention: grouped-query heads (half as many k/v heads, as in Llama) and a scale other than 1/√D
    kv_heads, scale = max(1, heads // 2), 1 / head_dim
    few_k, few_v = (t[:, :kv_heads].contiguous() for t in (k, v))
    reference = F.scaled_dot_product_attention(q, few_k, few_v, is_causal=True, scale=scale, enable_gqa=True)
    local_q, local_k, local_v = (t[:, :, positions].contiguous() for t in (q, few_k, few_v))
    with CollectiveLog("ring") as log:
        ring_out, _ = ring_attention(local_q, local_k, local_v, positions, positions.clone(), scale=scale)
    gathered_out = all_gather_attention(local_q, local_k, local_v, positions, positions.clone(), scale=scale)
    record["grouped_query"] = {
        "kv_heads": kv_heads, "scale": scale, "local_kv_bytes": local_bytes([local_k, local_v]),
        "collectives": log.records,
        "ring_max_error": (ring_out - reference[:, :, positions]).abs().max().item(),
        "all_gather_max_error": (gathered_out - reference[:, :, positions]).abs().max().item()}
    return record


PARTS = {"tp": _tensor_parallel_part, "2d": _two_d_part, "pp": _pipeline_part, "cp": _context_parallel_part}


def run_rank(rank: int, world: int, config: ModelParallelConfig, out: Path,
             parts: Sequence[str] = tuple(PARTS)) -> dict:
    """Everything one rank measures, part after part, in one process group; writes ``<out>/rank<r>.json``."""
    import datetime as dt

    import torch.distributed as dist
    torch.set_num_threads(1)        # the ranks share the machine's cores
    if not dist.is_initialized():
        dist.init_process_group("gloo", rank=rank, world_size=world,
                                timeout=dt.timedelta(seconds=config.collective_timeout_s))
    record: dict[str, Any] = {"rank": rank, "world_size": world, "torch": torch.__version__, "seconds": {},
                              "cpu_seconds": {"start": time.process_time()}}
    try:
        for part in parts:
            began, cpu = time.perf_counter(), time.process_time()
            record[part] = PARTS[part](config, rank, world)
            record["seconds"][part] = time.perf_counter() - began
            record["cpu_seconds"][part] = time.process_time() - cpu
            dist.barrier()
    finally:
        dist.destroy_process_group()
    Path(out).mkdir(parents=True, exist_ok=True)
    (Path(out) / f"rank{rank}.json").write_text(json.dumps(record, indent=1))
    return record


@dataclass
class ModelParallelRun:
    """What ``launch`` returns: each rank's record (by rank), the wall time of the launch, the folder."""

    ranks: list[dict]
    seconds: float
    out: Path
    config: ModelParallelConfig = field(default_factory=ModelParallelConfig)


def check_torch_version(version: str | None = None) -> None:
    """A RuntimeError if this torch is older than ``PIPELINING_ON_GLOO_FROM`` (its pipelining hangs on gloo)."""
    version = version or torch.__version__
    found = tuple(int(part) for part in version.split("+")[0].split(".")[:2])
    if found < PIPELINING_ON_GLOO_FROM:
        raise RuntimeError(f"torch {version}: torch.distributed.pipelining hangs on gloo before torch "
                           f"{'.'.join(map(str, PIPELINING_ON_GLOO_FROM))} (pytorch/pytorch#132644): expected torch >= "
                           f"{'.'.join(map(str, PIPELINING_ON_GLOO_FROM))}")


# The ranks start from a fresh Python, never from the caller (a Jupyter kernel runs threads, and forking a process
# with threads can deadlock the child). Through a stub ``utils`` package: the package's __init__ imports matplotlib
# for the notebooks' plots, which a rank never draws. "spawn": one fresh Python per rank, as torchrun starts them.
_RANK_BOOT = ("import sys, types\n"
              "package = types.ModuleType('utils'); package.__path__ = [sys.argv[1]]; sys.modules['utils'] = package\n"
              "from utils.model_parallel import main\n"
              "main(sys.argv[2:])\n")
# "forkserver": one fresh Python imports torch and the distributed modules once, then forks every rank from itself
# (each a copy with the imports done, no thread started yet) and waits for them (``serve_ranks``)
_SERVER_BOOT = ("import sys, types\n"
                "package = types.ModuleType('utils'); package.__path__ = [sys.argv[1]]; sys.modules['utils'] = package\n"
                "from utils.model_parallel import serve_ranks\n"
                "sys.exit(serve_ranks(int(sys.argv[2]), sys.argv[3], sys.argv[4:]))\n")
STARTS = ("forkserver", "spawn")
# what a rank imports, imported once by the fork server (about 1.5 CPU seconds of DTensor's own imports)
_PRELOAD = ("torch.distributed.device_mesh", "torch.distributed.tensor", "torch.distributed.tensor.parallel",
            "torch.distributed.fsdp", "torch.distributed.pipelining")


def script_arguments(config: ModelParallelConfig, out: Path | str, parts: Sequence[str]) -> list[str]:
    """The command-line arguments of ``python -m utils.model_parallel`` for ``config`` (``--world-size`` aside)."""
    fields = [f"--{name.replace('_', '-')}={value}" for name, value in asdict(config).items() if name != "world_size"]
    return [f"--out={out}", f"--parts={','.join(parts)}", *fields]


def serve_ranks(world_size: int, out: Path | str, argv: Sequence[str]) -> int:
    """The fork server of this module's ranks (``utils.fork_server.serve_ranks`` with ``main`` and DTensor's,
    FSDP's and pipelining's imports done once, and section 2's tracker). Returns 0 when every rank succeeded."""
    from . import fork_server
    return fork_server.serve_ranks(world_size, out, argv, main, preload=(*_PRELOAD, f"{__package__}.memory"))


def _rank_failure(out: Path, rank: int, code: int) -> LaunchError:
    log = (out / f"rank{rank}.log").read_text().splitlines()
    return LaunchError(f"rank {rank} failed (exit code {code}); the end of its log:\n" + "\n".join(log[-25:]), code,
                       "\n".join(log))


def _server_failure(out: Path, code: int) -> LaunchError:
    failure = out / "failure.json"
    if failure.exists():
        record = json.loads(failure.read_text())
        return _rank_failure(out, record["rank"], record["code"])
    log = (out / "server.log").read_text()
    return LaunchError(f"the fork server failed (exit code {code}) before its ranks did:\n{log[-2000:]}", code, log)


def launch(config: ModelParallelConfig, out: Path | str, *, parts: Sequence[str] = tuple(PARTS),
           timeout_s: float = 300.0, start: str = "forkserver") -> ModelParallelRun:
    """Start ``config.world_size`` CPU ranks (gloo), run ``parts`` in each, and read every rank's JSON back.

    Every argument is checked first (``check_config``: mesh, tensor-parallel divisibility, stages against
    layers, the sequence against the context-parallel degree), so bad input is a ValueError before any
    process starts. Each rank is told its rank as torchrun tells it (``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``,
    ``MASTER_PORT``); its output goes to ``<out>/rank<r>.log``. The launch as a whole has a time limit, after
    which every rank is killed; a rank that fails stops the others at once.

    Args:
        config: the model and the run.
        out: a folder for the ranks' JSON and logs (created).
        parts: any of ``"tp"``, ``"2d"``, ``"pp"``, ``"cp"``.
        timeout_s: seconds before every rank is killed.
        start: ``"forkserver"`` (default): one fresh Python imports torch and the distributed modules once and
            forks the ranks from itself (``serve_ranks``), so the imports, about 3 CPU seconds, are paid once,
            not once per rank; ``"spawn"``: one fresh Python per rank, as ``torchrun`` starts them.

    Returns:
        A ``ModelParallelRun``.

    Raises:
        ValueError: a layout the configuration cannot be split into, an unknown part or start method.
        LaunchError: a rank failed (the end of its log in the message) or the launch timed out.
    """
    import signal
    import subprocess
    import sys
    check_config(config)
    unknown = [p for p in parts if p not in PARTS]
    if unknown:
        raise ValueError(f"unknown parts {unknown}: expected some of {tuple(PARTS)}")
    if start not in STARTS:
        raise ValueError(f"start must be one of {STARTS}, got {start!r}")
    if "pp" in parts:
        check_torch_version()
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    for stale in [out / "failure.json", *out.glob("rank*.json")]:     # an earlier launch's, in the same folder
        stale.unlink(missing_ok=True)
    environment = {**os.environ, "WORLD_SIZE": str(config.world_size), "MASTER_ADDR": "127.0.0.1",
                   "MASTER_PORT": str(find_free_port()), "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    package, arguments = str(Path(__file__).resolve().parent), script_arguments(config, out, parts)
    began, processes = time.perf_counter(), []
    try:
        if start == "forkserver":     # one process; it and its ranks form a session, killed together
            with open(out / "server.log", "w") as log:
                processes.append(subprocess.Popen(
                    [sys.executable, "-c", _SERVER_BOOT, package, str(config.world_size), str(out), *arguments],
                    stdout=log, stderr=subprocess.STDOUT, env=environment, start_new_session=True))
        else:
            for rank in range(config.world_size):
                with open(out / f"rank{rank}.log", "w") as log:
                    processes.append(subprocess.Popen(
                        [sys.executable, "-c", _RANK_BOOT, package, *arguments], stdout=log, stderr=subprocess.STDOUT,
                        env=environment | {"RANK": str(rank), "LOCAL_RANK": str(rank)}))

        def failure(index: int) -> LaunchError:
            code = processes[index].returncode
            return _server_failure(out, code) if start == "forkserver" else _rank_failure(out, index, code)

        while any(process.poll() is None for process in processes):
            failed = [index for index, process in enumerate(processes) if process.returncode not in (None, 0)]
            if failed:
                raise failure(failed[0])
            if time.perf_counter() - began > timeout_s:
                raise LaunchError(f"the ranks did not finish in {timeout_s} s and were killed", None, "")
            time.sleep(0.05)
        failed = [index for index, process in enumerate(processes) if process.returncode != 0]
        if failed:
            raise failure(failed[0])
    finally:
        for process in processes:
            if process.poll() is None:
                if start == "forkserver":
                    os.killpg(process.pid, signal.SIGKILL)     # the server and every rank it forked
                else:
                    process.kill()
                process.wait()
    ranks = [json.loads((out / f"rank{r}.json").read_text()) for r in range(config.world_size)]
    return ModelParallelRun(ranks=ranks, seconds=time.perf_counter() - began, out=out, config=config)


def _parse_arguments(argv: Sequence[str] | None) -> tuple[argparse.Namespace, list[str], dict[str, Any]]:
    parser = argparse.ArgumentParser(prog="python -m utils.model_parallel", description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="folder for each rank's JSON")
    parser.add_argument("--parts", default=",".join(PARTS), help="comma-separated: tp, 2d, pp, cp")
    for name, value in asdict(ModelParallelConfig()).items():
        parser.add_argument(f"--{name.replace('_', '-')}", type=type(value), default=value)
    args = parser.parse_args(argv)
    return args, args.parts.split(","), {name: getattr(args, name) for name in asdict(ModelParallelConfig())}


def main(argv: Sequence[str] | None = None) -> None:
    """The command line: under torchrun, run this rank; from a shell, spawn the ranks (``--world-size``)."""
    args, parts, fields = _parse_arguments(argv)
    if "RANK" in os.environ:      # under torchrun: this process is one rank
        world = int(os.environ["WORLD_SIZE"])
        config = check_config(ModelParallelConfig(**(fields | {"world_size": world})))
        run_rank(int(os.environ["RANK"]), world, config, Path(args.out), parts)
        return
    run = launch(ModelParallelConfig(**fields), args.out, parts=parts)
    print(f"{len(run.ranks)} ranks, {run.seconds:.1f} s: results in {run.out}")


if __name__ == "__main__":
    main()
