"""Expert parallelism in the calculator: each MoE layer's experts split over ``ep`` ranks, what every rank holds,
keeps for backward and sends (notebook 14, whose ranks measure it; ``model_parallel`` uses it for ``--ep``).

The MoE layer is notebook 14's recipe as its ranks run it (``utils/expert_parallel_ranks.py``): route (a float32
softmax, top-k, the weights renormalised), dispatch (the ``T·k`` (token, slot) pairs sorted by expert, so by rank),
the counts' all-to-all (``E / ep`` int64 to every rank), the rows' ``all_to_all_single`` with the routing's split
sizes, the rows regrouped by local expert and run through each expert's SwiGLU in a loop, the way back, combine.
Rank ``r`` holds experts ``r·E/ep ... (r+1)·E/ep − 1``; each rank routes its own micro-batch (``T`` tokens), so
what it sends follows its own routing and what it receives, ``R_r`` rows, follows every rank's: the busiest rank
(the one whose experts are popular) keeps the most and sets the memory of all.

* ``routed_per_rank``: tokens per expert of each rank's micro-batch (balanced, one routing for all, or each rank's);
  ``pair_matrix``: the pairs rank ``r`` sends rank ``p``;
* ``moe_layer_saved_bytes``: what the layer keeps for backward on one rank, per token of its own (its input, the
  router's float32 softmax, the int64 top-k, the weights and their sum), per pair it sends (two int64 indices, the
  weight, the output twice: the weighting's input and ``index_add_``'s source), per row it receives (the row
  regrouped, gate-and-up, SiLU, product, two int64 permutations);
* ``all_to_all_calls``: every call of one step with the bytes sent to and received from each rank (forward: the
  counts, dispatch, combine; backward: the combine's and the dispatch's gradients);
* ``rank_state``: parameters, gradients and AdamW's state of one rank, its experts and the rest: FSDP2 shards the
  rest over the data-parallel ranks, storing weights and gradients padded to ``⌈d₀/N⌉`` rows while AdamW makes its
  moments from the rank's own rows;
* ``predict_expert_parallel``: all of it for every rank of a ``ParallelModel`` with experts.

Exactness. For notebook 14's model (a dense layer, this MoE layer with a residual, a dense output layer; fp32,
AdamW, FSDP2 for the rest) every rank's model state by part, what its forward keeps for backward, and every
all-to-all call's bytes to and from each peer equal what its ranks measure, to the byte
(``tests/test_calculator_moe.py`` launches them once). Inside a transformer (``model_parallel``'s ``moe`` design:
Mixtral, Qwen3-MoE, OLMoE with ``--ep``), in bf16 and with the experts' hidden units split by ``tp``, the same
counts are a model, not measured (transformers' own expert parallelism is not what is replayed); the all-to-all
buffers (the rows sent and received while one exchange runs, ``(T·k + R)·C`` elements) follow from the recipe.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Any, Sequence

from .config import TrainingSetup
from .optimizers import state_bytes
from .parallel_layout import ParallelLayout
from .parallel_tensors import ParallelModel, ParallelTensor


# --- the routing over the ranks ------------------------------------------------------------------------------------

def routed_per_rank(model: ParallelModel, tokens: int, ep: int, routing: Any = None) -> list[tuple[int, ...]]:
    """Tokens per expert of each expert-parallel rank's own micro-batch (``tokens · k`` pairs each).

    Args:
        model: a ``ParallelModel`` with experts.
        tokens: each rank's tokens (micro-batch × sequence / cp).
        ep: expert-parallel ranks.
        routing: None or ``"balanced"`` (``T·k / E`` each, the first ``T·k mod E`` one more); ``E`` counts (every
            rank routes alike); or ``ep`` tuples of ``E`` counts, one per rank.

    Raises:
        ValueError: counts that are not ``E`` per rank or do not sum to ``tokens · k``, or not one list per rank.
    """
    experts, pairs = model.experts, tokens * model.top_k
    if routing is None or routing == "balanced":
        return [tuple(pairs // experts + (e < pairs % experts) for e in range(experts))] * ep
    routing = tuple(tuple(r) if isinstance(r, (list, tuple)) else r for r in routing)
    per_rank = [routing] * ep if all(isinstance(n, int) for n in routing) else list(routing)
    if len(per_rank) != ep:
        raise ValueError(f"routing gives {len(per_rank)} ranks' tokens per expert for ep = {ep}: expected one list of "
                         f"{experts} counts for every rank, or one list per rank")
    for rank, counts in enumerate(per_rank):
        if len(counts) != experts or sum(counts) != pairs or min(counts) < 0:
            raise ValueError(f"routing of rank {rank}: {list(counts)}: expected {experts} counts >= 0 summing to "
                             f"tokens x k = {tokens} x {model.top_k} = {pairs}")
    return [tuple(counts) for counts in per_rank]


def pair_matrix(model: ParallelModel, per_rank: Sequence[Sequence[int]], ep: int) -> list[list[int]]:
    """``[r][p]``: the pairs rank ``r`` sends rank ``p`` (its rows for ``p``'s experts, its own included)."""
    local = model.experts // ep
    return [[sum(counts[p * local:(p + 1) * local]) for p in range(ep)] for counts in per_rank]


# --- what one rank keeps and sends ---------------------------------------------------------------------------------

def moe_layer_saved_bytes(model: ParallelModel, tokens: int, pairs: int, received: int, e: int, tp: int = 1) -> int:
    """Bytes one rank's MoE layer keeps for backward (notebook 14's recipe; ``e`` bytes per activation element).

    Per token: the layer's input (``C·e``), the router's float32 softmax (``4E``), the int64 top-k (``8k``) and, when
    renormalised, the float32 weights and their sum (``4k + 4``). Per pair sent: the token's index and the sort
    order (int64), the weight (``e``), the expert's output twice (``2C·e``). Per row received: the row regrouped by
    expert (``C·e``), gate-and-up, SiLU and product (``4F·e``, split ``tp`` ways), two int64 permutations.
    """
    c, f = model.width, model.expert_ffn
    router = 4 * model.experts + 8 * model.top_k + ((4 * model.top_k + 4) if model.normalize else 0)
    return (tokens * (c * e + router) + pairs * (2 * c * e + 16 + e)
            + received * (c * e + 4 * f * e // tp + 16))


def all_to_all_calls(model: ParallelModel, matrix: Sequence[Sequence[int]], rank: int, e: int) -> list[dict]:
    """One step's ``all_to_all_single`` calls of rank ``rank`` for one MoE layer, as ``utils.moe.AllToAllLog`` counts
    them: ``phase``, ``dtype``, and the bytes ``sent`` to and ``received`` from each rank (itself included)."""
    ep = len(matrix)
    row = model.width * e
    dtype = {4: "float32", 2: "bfloat16"}[e]
    sent = [matrix[rank][p] * row for p in range(ep)]
    got = [matrix[p][rank] * row for p in range(ep)]
    counts = [8 * (model.experts // ep)] * ep
    return [{"phase": "forward", "dtype": "int64", "sent": counts, "received": counts},
            {"phase": "forward", "dtype": dtype, "sent": sent, "received": got},       # dispatch
            {"phase": "forward", "dtype": dtype, "sent": got, "received": sent},       # combine
            {"phase": "backward", "dtype": dtype, "sent": sent, "received": got},      # the combine's gradient
            {"phase": "backward", "dtype": dtype, "sent": got, "received": sent}]      # the dispatch's


def _optimizer(shapes: Sequence[tuple[int, ...]], setup: TrainingSetup) -> tuple[int, int]:
    """(state bytes of the elements, step counters' bytes) of torch.optim for these tensors (``model_parallel``'s
    rule: the state in the parameters' dtype under pure bf16, the counters on the host on CUDA unless fused)."""
    total = state_bytes(list(shapes), setup.optimizer)
    steps = 4 * len(shapes) if setup.optimizer in ("adam", "adamw", "adafactor") else 0
    elements = total - steps
    if setup.precision == "bf16" and setup.optimizer != "adamw8bit":
        elements //= 2
    if setup.device == "cuda" and setup.optimizer_impl != "fused":
        steps = 0
    return elements, steps


def _local(tensor: ParallelTensor, tp: int, ep: int) -> tuple[int, ...]:
    shape = list(tensor.shape)
    if tensor.expert:
        shape[0] //= ep
    if tensor.tp_dim is not None and tp > 1:
        shape[tensor.tp_dim] //= tp
    return tuple(shape)


def rank_state(model: ParallelModel, setup: TrainingSetup, layout: ParallelLayout, rank: int = 0,
               places: Sequence[Any] | None = None) -> dict[str, dict[str, int]]:
    """Parameters, gradients and optimizer state of data-parallel rank ``rank``: ``{"experts": ..., "rest": ...}``.

    The experts: ``E / ep`` of each stack (split ``tp`` ways), replicated over the ``dp / ep`` copies, or, with
    ``zero=3``, FSDP2-sharded over them. The rest: split ``tp`` ways, then as the ZeRO stage says over ``dp``; with
    FSDP2 (``zero=3``) each tensor's dim 0 is cut in pieces of ``⌈d₀/N⌉`` rows, weights and gradients stored padded
    to it and AdamW's moments made from the rank's own rows (none past the end); a step counter for every tensor.

    Args:
        places: the pipeline places whose tensors count (None: all).
    """
    item = 2 if setup.precision == "bf16" else 4
    out = {}
    for part, is_expert in (("experts", True), ("rest", False)):
        tensors = [t for t in model.tensors if t.expert == is_expert and (places is None or t.place in places)]
        shapes = [_local(t, layout.tp, layout.ep) for t in tensors]
        dp = layout.dp // layout.ep if is_expert else layout.dp
        own_rank = rank % dp
        if layout.zero == 3 and dp > 1:
            stored = [(math.ceil(s[0] / dp),) + s[1:] for s in shapes]
            own = [(max(0, min(p[0], s[0] - own_rank * p[0])),) + s[1:] for s, p in zip(shapes, stored)]
            parameters = sum(math.prod(s) for s in stored) * item
            elements, steps = _optimizer(own, setup)
            out[part] = {"parameters": parameters, "gradients": parameters, "optimizer": elements + steps}
            continue
        parameters = sum(math.prod(s) for s in shapes) * item
        gradients = (sum(math.ceil(math.prod(s) * item / dp) for s in shapes) if layout.zero == 2 and dp > 1
                     else parameters)
        elements, steps = _optimizer(shapes, setup)
        if layout.zero in (1, 2) and dp > 1:
            elements, steps = math.ceil(elements / dp), 4 * math.ceil(steps // 4 / dp)
        out[part] = {"parameters": parameters, "gradients": gradients, "optimizer": elements + steps}
    return out


@dataclass(frozen=True)
class ExpertRank:
    """One expert-parallel rank of ``predict_expert_parallel``.

    Attributes:
        rank: its index; experts: the first and one past the last expert it holds.
        state: ``rank_state``'s ``{"experts": {...}, "rest": {...}}`` bytes.
        activations: what its forward keeps for backward, the layer inputs included (its own batch too), bytes.
        received_rows: the rows its experts receive per MoE layer, ``R``.
        all_to_all: every call of one step (all MoE layers), as ``all_to_all_calls`` lists them.
        comm_buffers: the rows sent and received while one exchange runs, bytes (modelled, not measured).
    """

    rank: int
    experts: tuple[int, int]
    state: dict[str, dict[str, int]]
    activations: int
    received_rows: int
    all_to_all: list[dict]
    comm_buffers: int

    @property
    def total(self) -> int:
        """Model state, activations and the all-to-all buffers, bytes."""
        return sum(sum(part.values()) for part in self.state.values()) + self.activations + self.comm_buffers


def dense_saved_bytes_per_token(model: ParallelModel, e: int) -> int:
    """What a module's dense layers keep per token beside the MoE layer: each ``nn.Linear`` (a 2-D ``*.weight`` that
    is not an expert) keeps its input, ``C·e`` (``from_module``'s models: notebook 14's dense layers)."""
    linears = [t for t in model.tensors if not t.expert and t.name.endswith("weight") and len(t.shape) == 2]
    return len(linears) * model.width * e


def predict_expert_parallel(model: ParallelModel, setup: TrainingSetup, layout: ParallelLayout,
                            routing: Any = None) -> list[ExpertRank]:
    """What every expert-parallel rank of ``layout`` holds, keeps and sends when training ``model``: the per-rank
    view notebook 14 measures (its model: ``ParallelModel.from_module(model, {}, heads=1, experts=("gate_up",
    "down"), top_k=k)``).

    Args:
        model: a ``ParallelModel`` with experts (``from_module(..., experts=...)``, or a transformer's
            ``from_config``/``from_hf``: then its MoE layers only, the attention left to ``predict_parallel``).
        setup: micro-batch, sequence, precision, optimizer (data parallelism is ``layout.dp`` and ``layout.zero``).
        layout: ``ep`` ranks (``dp`` a multiple of it), ``tp``, ``cp``.
        routing: as ``routed_per_rank`` takes it (each rank's tokens per expert, or one for all, or balanced).

    Returns:
        One ``ExpertRank`` per expert-parallel rank.

    Raises:
        ValueError: a model without experts, experts that do not split over ``ep``, routing that does not fit.

    Example:
        >>> ranks = predict_expert_parallel(model, TrainingSetup(micro_batch=1, seq_len=32, precision="fp32",
        ...                                 device="cpu"), ParallelLayout(dp=4, ep=4, zero=3))
        >>> [r.received_rows for r in ranks]
    """
    if not model.experts:
        raise ValueError(f"{model.name} has no experts: expected a ParallelModel of a mixture of experts")
    if model.experts % layout.ep:
        raise ValueError(f"{model.experts} experts cannot be split over ep = {layout.ep} ranks: expected an ep that "
                         "divides the experts")
    e = 4 if setup.precision == "fp32" else 2
    tokens = setup.micro_batch * setup.seq_len // layout.cp
    per_rank = routed_per_rank(model, tokens, layout.ep, routing)
    matrix = pair_matrix(model, per_rank, layout.ep)
    moe_layers = [i for i in range(model.layers) if i not in model.dense_layers]
    local = model.experts // layout.ep
    ranks = []
    for rank in range(layout.ep):
        received = sum(matrix[p][rank] for p in range(layout.ep))
        pairs = tokens * model.top_k
        saved = len(moe_layers) * moe_layer_saved_bytes(model, tokens, pairs, received, e, layout.tp)
        if not model.embedded:                            # a module's dense layers (the batch included)
            saved += tokens * dense_saved_bytes_per_token(model, e)
        calls = [call for _ in moe_layers for call in all_to_all_calls(model, matrix, rank, e)]
        ranks.append(ExpertRank(rank=rank, experts=(rank * local, (rank + 1) * local),
                                state=rank_state(model, setup, layout, rank), activations=saved,
                                received_rows=received, all_to_all=calls,
                                comm_buffers=(pairs + received) * model.width * e))
    return ranks


def busiest_received_rows(model: ParallelModel, tokens: int, ep: int, routing: Any = None) -> int:
    """The rows the busiest rank's experts receive per MoE layer (``T·k`` when balanced)."""
    return _busiest(model.experts, model.top_k, tokens, ep, routing)


@functools.lru_cache(maxsize=1024)
def _busiest(experts: int, top_k: int, tokens: int, ep: int, routing: Any) -> int:
    shape = ParallelModel("routing", (), 1, 1, 1, 1, 1, 0, experts=experts, top_k=top_k)
    matrix = pair_matrix(shape, routed_per_rank(shape, tokens, ep, routing), ep)
    return max(sum(matrix[p][rank] for p in range(ep)) for rank in range(ep))
