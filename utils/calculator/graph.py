"""The replay's objects: storages (``_Buf``), tensors (``_T``), parameters (``_Leaf``), autograd nodes and edges,
checkpoint regions, and the ``Phase`` records the engine (``replay.py``) keeps of a step."""

from __future__ import annotations

import math
from typing import Any, Callable, Sequence


class _Buf:
    """One storage: its bytes, what it is (a ``KINDS`` entry), how many references keep it alive, and the block
    whose phase allocated it (``tag``; None outside the blocks)."""

    __slots__ = ("nbytes", "kind", "label", "refs", "tag")

    def __init__(self, nbytes: int, kind: str, label: str, tag: int | None = None) -> None:
        self.nbytes, self.kind, self.label, self.refs, self.tag = nbytes, kind, label, 0, tag


class Phase:
    """One phase of a replayed step, relative to its start (see the module's docstring).

    Attributes:
        name: ``"init"``, ``"begin"``, ``"m0.embed"``, ``"m0.f3"`` (block 3's forward), ``"m0.head"``,
            ``"m0.outputs"``, ``"m0.loss"``, ``"m0.exit"``, ``"m0.bloss"``, ``"m0.b3"``, ``"optimizer"``, ``"end"``.
        start, end: bytes alive by kind when it began and ended.
        top: the highest point reached by an allocation, relative to the start's total (None: it allocated
            nothing); top_kinds: what was alive then, by kind, relative to ``start``.
        kind_top: each kind's highest point in the phase, relative to its value at the start (0 or more).
        tag_frees: for a phase that is not a block's: block index -> bytes by kind that it freed (negative), made
            (a cache layer's tensor, positive) or moved from kind to kind, of that block's tensors.
        freed_then_allocated: the blocks whose tensors it freed before allocating something (its top then
            depends on how many such blocks there are).
    """

    __slots__ = ("name", "start", "end", "top", "top_kinds", "kind_top", "tag_frees", "freed_then_allocated",
                 "tagged_allocs", "untagged_allocs")

    def __init__(self, name: str, start: dict[str, int]) -> None:
        self.name, self.start, self.end = name, start, dict(start)
        self.top: int | None = None
        self.top_kinds: dict[str, int] = {}
        self.kind_top = dict.fromkeys(start, 0)
        self.tag_frees: dict[int, dict[str, int]] = {}
        self.freed_then_allocated: set[int] = set()
        self.tagged_allocs = False                 # it made a block's tensors (a cache layer's), ...
        self.untagged_allocs = False               # ... and tensors of no block

    def delta(self) -> dict[str, int]:
        """end - start, by kind."""
        return {kind: self.end[kind] - self.start[kind] for kind in self.start}


class _Leaf:
    """A parameter (or a leaf tensor that requires grad): its shape, bytes per element, whether it trains, and
    its gradient once it has one (counted as ``grad_kind``)."""

    __slots__ = ("name", "shape", "item", "trainable", "grad", "tensor", "sink", "grad_kind")

    def __init__(self, name: str, shape: tuple[int, ...], item: int, trainable: bool,
                 grad_kind: str = "gradients") -> None:
        self.name, self.shape, self.item, self.trainable = name, shape, item, trainable
        self.grad: _Buf | None = None
        self.tensor: _T | None = None
        self.sink: _Node | None = None        # its AccumulateGrad node while a backward runs
        self.grad_kind = grad_kind

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


class _T:
    """A tensor: a view of a storage, with autograd's metadata (requires grad, grad_fn and output slot)."""

    __slots__ = ("buf", "numel", "item", "rg", "node", "slot", "leaf")

    def __init__(self, buf: _Buf, numel: int, item: int, rg: bool = False, node: "_Node | None" = None,
                 slot: int = 0, leaf: _Leaf | None = None) -> None:
        self.buf, self.numel, self.item, self.rg, self.node, self.slot, self.leaf = buf, numel, item, rg, node, slot, leaf

    @property
    def nbytes(self) -> int:
        return self.numel * self.item


class _Edge:
    """Where the gradient of one input goes, and how the node's backward produces it.

    ``mode``: "alloc" (backward allocates it, in the input's size and dtype), "pass" (it is the incoming
    gradient itself; autograd's validate_outputs then sums it down to the input's shape and casts it to the
    input's dtype when they differ), or a callable of the node's incoming gradients (custom rules).
    """

    __slots__ = ("src", "mode")

    def __init__(self, src: _T, mode: Any = "alloc") -> None:
        self.src, self.mode = src, mode


class _Node:
    """An autograd node: what backward allocates, in which order, and what it keeps alive until it runs."""

    __slots__ = ("seq", "name", "edges", "order", "saved", "holders", "region", "slots", "buffer", "deps",
                 "phase", "custom", "leaf", "out_item", "out_numel")

    def __init__(self, seq: int, name: str, edges: list[_Edge], order: Sequence[int] | None = None,
                 slots: int = 1) -> None:
        self.seq, self.name, self.edges = seq, name, edges
        self.order = list(range(len(edges))) if order is None else list(order)
        self.saved: list[_Buf] = []
        self.holders: list[int] = []            # checkpoint holders this node unpacks
        self.region: _Region | None = None
        self.slots = slots
        self.buffer: list[_T | None] = [None] * slots
        self.deps = 0
        self.phase: str | None = None
        self.custom: Callable[..., list[_T | None]] | None = None
        self.leaf: _Leaf | None = None
        self.out_item = 4
        self.out_numel = 0


class _Stop(Exception):
    """Checkpoint's early stop: every tensor the region saved has been recomputed."""


class _Region:
    """A non-reentrant checkpoint region: its forward, its kept inputs, and what recompute holds."""

    def __init__(self, fn: Callable[["_Replay", _T], _T], inputs: list[_T], selective: bool) -> None:
        self.fn, self.inputs, self.selective = fn, inputs, selective
        self.saved_count = 0
        self.holders: dict[int, _Buf] = {}
        self.sac: list[_Buf] = []               # matmul outputs selective checkpointing stored in forward
        self.sac_next = 0
        self.recomputed = False
        self.pending = 0                         # nodes whose saved-tensor hooks keep the frame alive
        self.autocast = False                    # autocast was on in forward: recompute runs under it too


def _shard_numel(shape: Sequence[int], ranks: int) -> int:
    """Elements of one rank's shard of a tensor under FSDP2: dim 0 split in N, padded (``ceil(dim0 / N)`` rows)."""
    if ranks == 1:
        return math.prod(shape)
    return math.ceil(shape[0] / ranks) * math.prod(shape[1:])
