"""The launched script of notebook 14: expert parallelism with FSDP2 on CPU ranks, each rank measuring itself.

Introduced in notebook 14 (mixture of experts). Every rank holds ``num_experts / world_size`` experts and its own
batch of tokens (data parallelism). One step: the dense layer, then the MoE layer, whose tokens travel to the
ranks holding their experts by ``all_to_all_single`` with the routing's uneven split sizes and come back the same
way, then the output layer; FSDP2 shards everything but the experts over the same ranks. Each rank compares its
output and gradients with one process that holds every expert and every rank's batch, and records the bytes it
holds by category, the bytes autograd saved, and every all-to-all call with the bytes sent to and received from
each rank (``utils.moe.AllToAllLog``).

* **The recipe** the notebook shows, copied here (the notebook checks that its cells are this code): ``route``,
  ``dispatch``, ``run_experts``, ``combine``, ``AllToAll``, ``expert_parallel_forward``, ``shard_expert_parallel``.
* **The rank**: ``run_rank`` (one step, measured, written to ``<out>/rank<r>.json``), ``serve_ranks`` (the fork
  server ``utils.moe.launch_expert_parallel`` starts), ``main`` (the command line: under torchrun, one rank:
  ``python -m torch.distributed.run --standalone --nproc-per-node 4 -m utils.expert_parallel_ranks --out DIR``).

Known limitations: gloo on the CPU: bytes and split sizes are exact, speed is not measured.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from .moe import (AllToAllLog, ExpertParallelConfig, SavedActivationBytes, check_expert_parallel_config,
                  clustered_tokens, state_bytes_by_part, token_centres)


# --- the recipe (notebook 14's cells, line for line) ------------------------------------------------------------------

def route(x: torch.Tensor, router: torch.Tensor, top_k: int, normalize: bool = True) -> tuple:
    """Each token's k experts and their weights: a softmax over the experts, the k largest, renormalised or not."""
    logits = F.linear(x, router)                                   # (T, E): one score per expert
    probs = logits.softmax(dim=-1, dtype=torch.float32)            # in fp32, whatever the model's dtype
    weights, experts = probs.topk(top_k, dim=-1)                   # (T, k) each, the best expert first
    if normalize:                                                  # Mixtral: always; Qwen3-MoE, OLMoE: norm_topk_prob
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return logits, weights.to(x.dtype), experts


def dispatch(experts: torch.Tensor, num_experts: int) -> tuple:
    """Sort the (token, slot) pairs by expert: their order, the token of each, and how many each expert gets."""
    flat = experts.flatten()                                       # (T·k,) the expert of each pair, token by token
    order = flat.argsort(stable=True)                              # grouped by expert, in token order within each
    tokens = order // experts.shape[-1]                            # (T·k,) the token each sorted pair comes from
    counts = torch.bincount(flat, minlength=num_experts)           # (E,) the tokens each expert receives
    return order, tokens, counts


def run_experts(xs: torch.Tensor, counts: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor) -> torch.Tensor:
    """One SwiGLU MLP per expert over its rows of ``xs`` (sorted by expert): a loop of two matmuls each."""
    outputs = []
    for expert, rows in enumerate(xs.split(counts.tolist())):
        gate, up = F.linear(rows, gate_up[expert]).chunk(2, dim=-1)    # gate_up: (E, 2F, C), gate first
        outputs.append(F.linear(F.silu(gate) * up, down[expert]))      # down: (E, C, F)
    return torch.cat(outputs)                                          # (T·k, C), still sorted by expert


def combine(ys: torch.Tensor, weights: torch.Tensor, order: torch.Tensor, tokens: torch.Tensor,
            num_tokens: int) -> torch.Tensor:
    """Each token's output: its k experts' outputs, each times its router weight, summed."""
    weighted = ys * weights.flatten()[order, None]                      # (T·k, C)
    return ys.new_zeros(num_tokens, ys.shape[-1]).index_add_(0, tokens, weighted)


class AllToAll(torch.autograd.Function):
    """``all_to_all_single`` with uneven splits that autograd can go through: backward sends the gradients back."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, send: list, receive: list, group: Any = None) -> torch.Tensor:
        import torch.distributed as dist
        ctx.send, ctx.receive, ctx.group = send, receive, group
        out = x.new_empty(sum(receive), *x.shape[1:])                 # receive[r] rows come from rank r
        dist.all_to_all_single(out, x.contiguous(), receive, send, group=group)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:
        import torch.distributed as dist
        out = grad.new_empty(sum(ctx.send), *grad.shape[1:])          # each row's gradient goes home
        dist.all_to_all_single(out, grad.contiguous(), ctx.send, ctx.receive, group=ctx.group)
        return out, None, None, None


def expert_parallel_forward(x: torch.Tensor, router: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor,
                            top_k: int, normalize: bool = True, group: Any = None) -> tuple:
    """The MoE layer with its experts over the ranks: rank r holds experts r·n ... r·n + n - 1 (gate_up, down)."""
    import torch.distributed as dist
    world, local = dist.get_world_size(group), gate_up.shape[0]
    logits, weights, experts = route(x, router, top_k, normalize)
    order, tokens, counts = dispatch(experts, world * local)       # sorted by expert is sorted by rank too
    received = torch.empty_like(counts)                            # first the counts: what each rank will send me
    dist.all_to_all_single(received, counts, group=group)          # (world·local,): rank r's rows for my experts
    send, receive = counts.view(world, local).sum(1).tolist(), received.view(world, local)
    inbox = AllToAll.apply(x[tokens], send, receive.sum(1).tolist(), group)    # by source rank, then expert
    by_expert = torch.arange(local).repeat(world).repeat_interleave(receive.flatten()).argsort(stable=True)
    ys = run_experts(inbox[by_expert], receive.sum(0), gate_up, down)          # my experts, each once
    ys = AllToAll.apply(ys[by_expert.argsort()], receive.sum(1).tolist(), send, group)   # back where they came from
    return combine(ys, weights, order, tokens, x.shape[0]), logits


def shard_expert_parallel(model: nn.Module, mesh: Any, expert_parameters: Sequence[nn.Parameter]) -> nn.Module:
    """FSDP2 shards every parameter but the experts over the ranks; expert parallelism has split those already."""
    from torch.distributed.fsdp import fully_shard
    fully_shard(model, mesh=mesh, ignored_params=set(expert_parameters))
    return model


# --- the model and the data every rank builds ---------------------------------------------------------------------

class TinyMoEModel(nn.Module):
    """A dense layer, the MoE layer with a residual, a dense output layer; with ``experts``, only those experts.

    The same seed gives the same weights whichever experts a rank keeps, so one process with every expert is
    the reference every rank compares itself with.
    """

    def __init__(self, config: ExpertParallelConfig, experts: range | None = None) -> None:
        super().__init__()
        torch.manual_seed(config.seed)
        c, f, e = config.width, config.ffn, config.num_experts
        self.inp = nn.Linear(c, c)
        self.router = nn.Parameter(torch.randn(e, c) * c**-0.5)
        gate_up, down = torch.randn(e, 2 * f, c) * c**-0.5, torch.randn(e, c, f) * f**-0.5
        self.experts = range(e) if experts is None else experts
        self.gate_up = nn.Parameter(gate_up[self.experts.start:self.experts.stop].clone())
        self.down = nn.Parameter(down[self.experts.start:self.experts.stop].clone())
        self.out = nn.Linear(c, c)
        self.top_k, self.expert_parallel = config.top_k, experts is not None
        self.routing: list | None = None          # the last forward's experts of each token, T lists of k

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        if self.expert_parallel:
            moe, logits = expert_parallel_forward(h, self.router, self.gate_up, self.down, self.top_k)
            with torch.no_grad():                     # a list, not a tensor: kept outside the measured bytes
                self.routing = logits.topk(self.top_k, dim=-1).indices.tolist()
        else:
            logits, weights, experts = route(h, self.router, self.top_k)
            order, tokens, counts = dispatch(experts, self.gate_up.shape[0])
            moe = combine(run_experts(h[tokens], counts, self.gate_up, self.down), weights, order, tokens, h.shape[0])
            self.routing = experts.tolist()
        return self.out(h + moe)


def make_batches(config: ExpertParallelConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """Every rank's inputs and targets, ``(world_size, tokens_per_rank, width)`` each: clustered tokens."""
    generator = torch.Generator().manual_seed(config.seed + 1)
    tokens = config.world_size * config.tokens_per_rank
    centres = token_centres(config.clusters, config.width, generator=generator)
    inputs = clustered_tokens(tokens, centres, generator=generator)
    targets = torch.randn(tokens, config.width, generator=generator)
    shape = (config.world_size, config.tokens_per_rank, config.width)
    return inputs.view(shape), targets.view(shape)


# --- one rank ---------------------------------------------------------------------------------------------------------

def _max_error(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.detach() - b.detach()).abs().max().item()


def run_rank(rank: int, world: int, config: ExpertParallelConfig, out: Path) -> dict:
    """One expert-parallel training step on this rank, measured; writes and returns ``<out>/rank<r>.json``."""
    import datetime as dt

    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    torch.set_num_threads(1)                         # the ranks share the machine's cores
    cpu = time.process_time()
    if not dist.is_initialized():
        dist.init_process_group("gloo", rank=rank, world_size=world,
                                timeout=dt.timedelta(seconds=config.collective_timeout_s))
    try:
        inputs, targets = make_batches(config)
        reference = TinyMoEModel(config)             # one process: every expert, every rank's batch
        reference_out = reference(inputs.flatten(0, 1))
        F.mse_loss(reference_out, targets.flatten(0, 1)).backward()
        reference_out = reference_out.detach().view(inputs.shape)[rank]
        reference_routing = reference.routing[rank * config.tokens_per_rank:(rank + 1) * config.tokens_per_rank]
        local = config.num_experts // world
        mesh = init_device_mesh("cpu", (world,))
        x, y = inputs[rank].clone(), targets[rank].clone()
        model = TinyMoEModel(config, range(rank * local, (rank + 1) * local))
        experts = [model.gate_up, model.down]
        shard_expert_parallel(model, mesh, experts)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=False)
        with AllToAllLog() as log:
            with SavedActivationBytes(model) as saved:
                output = model(x)
            loss = F.mse_loss(output, y)
            log.phase = "backward"
            loss.backward()
        for parameter in experts:                    # each expert served every rank's tokens: average them,
            parameter.grad /= world                  # as FSDP2 averages the other gradients over the ranks
        optimizer.step()                             # (the gradients stay: compared below)
        rest = {n: p for n, p in model.named_parameters() if not n.startswith(("gate_up", "down"))}
        state = state_bytes_by_part({"experts": experts, "rest": list(rest.values())}, optimizer)
        named_reference = dict(reference.named_parameters())
        record: dict[str, Any] = {
            "rank": rank, "world_size": world, "torch": torch.__version__, "config": asdict(config),
            "experts_held": [rank * local, (rank + 1) * local],
            "max_output_error": _max_error(output, reference_out),
            "max_expert_grad_error": max(_max_error(p.grad, named_reference[n].grad[rank * local:(rank + 1) * local])
                                         for p, n in zip(experts, ("gate_up", "down"))),
            "max_rest_grad_error": max(_max_error(p.grad.full_tensor(), named_reference[n].grad)
                                       for n, p in rest.items()),
            "same_routing_as_one_process": model.routing == reference_routing,
            "routing": model.routing, "loss": loss.item(),
            "state_bytes": state, "activation_bytes": saved.bytes,
            "all_to_all": log.calls,
            "local_parameter_shapes": {n: list(getattr(p, "to_local", lambda p=p: p)().shape)
                                       for n, p in model.named_parameters()},
        }
    finally:
        dist.destroy_process_group()
    record["cpu_seconds"] = time.process_time() - cpu
    Path(out).mkdir(parents=True, exist_ok=True)
    (Path(out) / f"rank{rank}.json").write_text(json.dumps(record, indent=1))
    return record


# --- the fork server and the command line -----------------------------------------------------------------------------

def serve_ranks(world_size: int, out: Path | str, argv: Sequence[str]) -> int:
    """The fork server of this module's ranks (``utils.fork_server.serve_ranks`` with ``main``; FSDP2's first
    forward imports torch._dynamo: once in the server, not once per rank). Returns 0 when every rank succeeded."""
    from . import fork_server
    return fork_server.serve_ranks(world_size, out, argv, main, preload=(
        "torch._dynamo", "torch.distributed.device_mesh", "torch.distributed.fsdp"))


def main(argv: Sequence[str] | None = None) -> None:
    """The command line: under torchrun (``RANK`` set), run this rank; from a shell, launch the ranks."""
    parser = argparse.ArgumentParser(prog="python -m utils.expert_parallel_ranks", description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="folder for each rank's JSON")
    for name, value in asdict(ExpertParallelConfig()).items():
        parser.add_argument(f"--{name.replace('_', '-')}", type=type(value), default=value)
    args = parser.parse_args(argv)
    values = {name: getattr(args, name) for name in asdict(ExpertParallelConfig())}
    if "RANK" in os.environ:
        world = int(os.environ["WORLD_SIZE"])
        config = check_expert_parallel_config(ExpertParallelConfig(**(values | {"world_size": world})))
        run_rank(int(os.environ["RANK"]), world, config, Path(args.out))
        return
    from .moe import launch_expert_parallel
    run = launch_expert_parallel(ExpertParallelConfig(**values), args.out)
    print(f"{len(run.ranks)} ranks, {run.seconds:.1f} s: results in {run.out}")


if __name__ == "__main__":
    main()
