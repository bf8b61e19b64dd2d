"""The replay engine: storages, tensors, autograd nodes, and a backward engine that runs them in autograd's order.

A replay is one training step as eager PyTorch performs it, told as allocations and frees: every op
(``ops.py``) allocates its outputs and records an autograd node that keeps what its backward needs;
``_Replay.backward`` runs those nodes highest sequence number first, as autograd does, summing the
gradients that meet, casting them to their inputs' dtype, and handing each parameter its ``.grad``.
Non-reentrant checkpointing (``_Region``) packs holders instead of tensors and recomputes a block when
its backward begins; reentrant checkpointing runs the block without autograd and, in backward, recomputes
it whole and runs a backward of its own (``step.py``).

The replay is cut into phases (the step's set-up, each block's forward and backward, the head, the loss,
the optimizer); for each it keeps a ``Phase``: the bytes alive by kind (``KINDS``) when it began and ended,
its highest point relative to its start and what was alive then, each kind's highest point, and, for the
phases that are not a block's, what they freed of each block's tensors. ``layer_reuse.compose`` turns a list
of phases into the step's peak; it is how one replayed decoder layer stands for every identical one.
"""

from __future__ import annotations

import heapq
import itertools
import sys
from typing import Any, Callable, Iterable, Sequence

from .config import KINDS
from .graph import Phase, _Buf, _Edge, _Leaf, _Node, _Region, _Stop, _T, _shard_numel  # noqa: F401  (re-exported)

class _Replay:
    """Replays one training step as allocations and frees; remembers the highest point and what was alive.

    Forward code calls the op methods (``linear``, ``layer_norm``, ...) in the order eager PyTorch runs them
    and ``rel`` where Python drops a reference; ``backward`` runs the autograd graph those ops recorded.
    """

    def __init__(self, device: str = "cuda", trace: bool = False) -> None:
        self.device = device
        self.current = 0
        self.by_kind = dict.fromkeys(KINDS, 0)
        self.peak = -1
        self.peak_kinds: dict[str, int] = {}
        self.peak_phase = ""
        self.phase = "init"
        self.largest = dict.fromkeys(KINDS, 0)
        self.trace: list[tuple[str, int, str]] | None = [] if trace else None
        self.seq = itertools.count()
        self.grad_enabled = True
        self.autocast = False
        self.cache: dict[int, _T] | None = None          # autocast's weight cache: leaf id -> bf16 copy
        self.region: _Region | None = None               # the checkpoint region being run
        self.recomputing: _Region | None = None
        self.scope: list[_T] | None = None                # Python references a recompute holds
        self.micro = 0
        self.phase_marks: dict[str, int] = {}             # phase -> bytes live when it ended (for validation)
        self.param_shards = 1                             # FSDP keeps 1/N of every parameter at rest
        self.shard_grads = False                          # ZeRO-2 and FSDP reduce-scatter gradients
        self.phases: list[Phase] = []
        self._open = Phase(self.phase, dict(self.by_kind))
        self._phase_total = 0                             # bytes alive when the open phase began
        self.layer_tag: int | None = None                 # the block whose phase is open (None: not a block's)
        self._freed_tagged = False
        self._at_top = self._at_peak = False              # the present moment is the phase's top, the step's peak

    # -- storage bookkeeping
    def _alloc(self, nbytes: int, kind: str, label: str, tag: int | None = None) -> _Buf:
        buf = _Buf(nbytes, kind, label, self.layer_tag if tag is None else tag)
        if nbytes:
            if tag is not None and self.layer_tag is None:      # a block's tensor made outside the blocks
                made = self._open.tag_frees.setdefault(tag, {})
                made[kind] = made.get(kind, 0) + nbytes
                self._open.tagged_allocs = True
            elif self.layer_tag is None:
                self._open.untagged_allocs = True
            self.current += nbytes
            by_kind = self.by_kind
            by_kind[kind] += nbytes
            if by_kind[kind] > self.largest[kind]:
                self.largest[kind] = by_kind[kind]
            opened = self._open
            if by_kind[kind] - opened.start[kind] > opened.kind_top[kind]:
                opened.kind_top[kind] = by_kind[kind] - opened.start[kind]
            rise = self.current - self._phase_total
            if opened.top is None or rise > opened.top:
                opened.top = rise
                self._at_top = True                      # what is alive at the top: copied when it changes
            if self._freed_tagged:
                opened.freed_then_allocated.update(opened.tag_frees)
            if self.trace is not None:
                self.trace.append((self.phase, nbytes, label))
            if self.current > self.peak:
                self.peak, self.peak_phase = self.current, self.phase
                self._at_peak = True
        return buf

    def _snapshot(self) -> None:
        """Copy what is alive, by kind, for the phase's top and the step's peak if they are the present moment
        (called before anything changes it: a free, a change of kind, the phase's end)."""
        if self._at_top:
            opened = self._open
            opened.top_kinds = {k: v - opened.start[k] for k, v in self.by_kind.items()}
            self._at_top = False
        if self._at_peak:
            self.peak_kinds = dict(self.by_kind)
            self._at_peak = False

    def incref(self, buf: _Buf) -> None:
        buf.refs += 1

    def decref(self, buf: _Buf) -> None:
        buf.refs -= 1
        if buf.refs == 0 and buf.nbytes:
            if self._at_top or self._at_peak:
                self._snapshot()
            self.current -= buf.nbytes
            self.by_kind[buf.kind] -= buf.nbytes
            if buf.tag is not None and self.layer_tag is None:    # a block's tensor freed outside the blocks
                frees = self._open.tag_frees.setdefault(buf.tag, {})
                frees[buf.kind] = frees.get(buf.kind, 0) - buf.nbytes
                self._freed_tagged = True
            if self.trace is not None:
                self.trace.append((self.phase, -buf.nbytes, "free " + buf.label))
        elif buf.refs < 0:  # pragma: no cover - a bug in the replay, not in the input
            raise AssertionError(f"{buf.label} released more often than referenced")

    def set_phase(self, phase: str) -> None:
        """End the open phase and begin ``phase`` (``m<micro>.f<i>`` / ``.b<i>``: block i's, tagged i)."""
        self._snapshot()
        self.phase_marks[self.phase] = self.current
        self._open.end = dict(self.by_kind)
        self.phases.append(self._open)
        self.phase = phase
        self._open = Phase(phase, dict(self.by_kind))
        self._phase_total = self.current
        self._freed_tagged = False
        where = phase.rpartition(".")[2]
        self.layer_tag = int(where[1:]) if where[:1] in ("f", "b") and where[1:].isdigit() else None

    def finish(self) -> None:
        """Close the last phase: the step has ended and ``phases`` holds every one of them."""
        self._snapshot()
        self.phase_marks[self.phase] = self.current
        self._open.end = dict(self.by_kind)
        self.phases.append(self._open)

    def retag(self, buf: _Buf, kind: str) -> None:
        """Count a live storage as another kind from now on (a gradient autograd hands to a parameter)."""
        if buf.refs > 0:
            self._snapshot()
            self.by_kind[buf.kind] -= buf.nbytes
            self.by_kind[kind] += buf.nbytes
            if self.by_kind[kind] > self.largest[kind]:
                self.largest[kind] = self.by_kind[kind]
            opened = self._open
            if self.by_kind[kind] - opened.start[kind] > opened.kind_top[kind]:
                opened.kind_top[kind] = self.by_kind[kind] - opened.start[kind]
            if buf.tag is not None and self.layer_tag is None:
                moved = self._open.tag_frees.setdefault(buf.tag, {})
                moved[buf.kind] = moved.get(buf.kind, 0) - buf.nbytes
                moved[kind] = moved.get(kind, 0) + buf.nbytes
        buf.kind = kind

    # -- tensors held by Python
    def new(self, numel: int, item: int, kind: str, label: str, rg: bool = False, tag: int | None = None) -> _T:
        """A fresh tensor with one Python reference (``tag``: the block it belongs to, made outside its phases)."""
        t = _T(self._alloc(numel * item, kind, label, tag), numel, item, rg)
        self.incref(t.buf)
        if self.scope is not None:
            self.scope.append(t)
        return t

    def view(self, t: _T, numel: int | None = None) -> _T:
        """A view (no storage of its own): same storage, same autograd history."""
        v = _T(t.buf, t.numel if numel is None else numel, t.item, t.rg, t.node, t.slot, t.leaf)
        self.incref(v.buf)
        if self.scope is not None:
            self.scope.append(v)
        return v

    def rel(self, *ts: _T | None) -> None:
        """Python drops its reference (a local rebinds, a temporary's expression ends)."""
        for t in ts:
            if t is None:
                continue
            if self.scope is not None and t in self.scope:
                self.scope.remove(t)
            self.decref(t.buf)

    # -- autograd records
    def node(self, name: str, inputs: list[tuple[_T, Any]], order: Sequence[int] | None = None, slots: int = 1,
             saved: Iterable[_T] = ()) -> _Node | None:
        """Record an autograd node if any input needs a gradient; ``saved`` is what its backward keeps.

        Args:
            inputs: (tensor, mode) for every differentiable input (see ``_Edge``).
            order: the order in which backward allocates the inputs' gradients (indices into inputs).
            saved: tensors saved for backward, in the order autograd packs them.
        """
        if not self.grad_enabled or not any(t.rg for t, _ in inputs):
            return None
        if self.recomputing is not None:          # recompute: the node is discarded, what it saves goes to holders
            for t in saved:
                self._pack_recomputed(t)
            return _Node(-1, name, [])
        n = _Node(next(self.seq), name, [_Edge(t, mode) for t, mode in inputs], order, slots)
        region = self.region
        for t in saved:
            if region is None:
                self.incref(t.buf)
                n.saved.append(t.buf)
            else:                                   # non-reentrant checkpoint packs a holder, not the tensor
                n.holders.append(region.saved_count)
                region.saved_count += 1
        n.region = region
        if n.holders:
            region.pending += 1
        return n

    def _pack_recomputed(self, t: _T) -> None:
        region = self.recomputing
        assert region is not None
        index = len(region.holders)
        region.holders[index] = t.buf
        self.incref(t.buf)
        if len(region.holders) == region.saved_count:
            raise _Stop

    def save(self, n: _Node | None, *outputs: _T) -> None:
        """Save outputs of an op that ran (autograd saves inputs before the op runs, outputs after)."""
        if n is None:
            return
        if self.recomputing is not None:
            for t in outputs:
                self._pack_recomputed(t)
            return
        for t in outputs:
            if self.region is None:
                self.incref(t.buf)
                n.saved.append(t.buf)
            else:
                if not n.holders:
                    self.region.pending += 1
                n.holders.append(self.region.saved_count)
                self.region.saved_count += 1

    def output(self, t: _T, n: _Node | None, slot: int = 0) -> _T:
        """Attach ``t`` to node ``n`` (or mark it as not needing a gradient)."""
        t.rg = n is not None
        t.node, t.slot = n, slot
        return t

    # -- parameters and autocast
    def param(self, leaf: _Leaf) -> _T:
        """The tensor of a parameter (alive for the whole step, counted in the baseline)."""
        if leaf.tensor is None:
            buf = self._alloc(_shard_numel(leaf.shape, self.param_shards) * leaf.item, "parameters", leaf.name)
            self.incref(buf)
            leaf.tensor = _T(buf, leaf.numel, leaf.item, leaf.trainable, None, 0, leaf)
        return leaf.tensor

    def cast16(self, t: _T, label: str) -> _T:
        """Autocast's cast of an fp32 input to bf16 (cached for trainable parameters until autocast exits)."""
        if t.item == 2:
            return self.view(t)
        cacheable = t.leaf is not None and t.leaf.trainable and self.cache is not None
        if cacheable and id(t.leaf) in self.cache:
            return self.view(self.cache[id(t.leaf)])
        kind = "weight_copies" if t.leaf is not None else "activations"
        n = self.node("ToCopyBackward", [(t, "alloc")])
        c = self.output(self.new(t.numel, 2, kind, label), n)
        if cacheable:
            self.cache[id(t.leaf)] = c
            self.incref(c.buf)
        return c

    def autocast_exit(self) -> None:
        """Leaving ``torch.autocast`` clears its cache: copies nothing saved die here."""
        cache, self.cache = self.cache, None
        self.autocast = False
        for t in (cache or {}).values():
            self.decref(t.buf)

    # -- the backward engine
    def backward(self, root: _T, grad: _T | None = None) -> None:
        """``root.backward()`` (or ``torch.autograd.backward(root, grad)``): run every node that leads to a leaf
        that requires grad, in autograd's order."""
        seed = self.new(root.numel, root.item, "temporaries", "grad seed") if grad is None else grad
        nodes = self._collect(root.node)
        heap: list[tuple[float, int, _Node]] = []
        tie = itertools.count()
        root.node.deps += 1
        self._receive(root.node, root.slot, seed, heap, tie)
        while heap:
            _, _, n = heapq.heappop(heap)
            if n.phase is not None:
                self.set_phase(n.phase)
            self._run(n, heap, tie)
        for leaf_node in [n for n in nodes if n.leaf is not None]:
            leaf_node.leaf.sink = None
        if grad is None:
            self.rel(seed)

    def _collect(self, root: _Node | None) -> list[_Node]:
        seen: dict[int, _Node] = {}
        stack = [root] if root is not None else []
        while stack:
            n = stack.pop()
            if id(n) in seen:
                continue
            seen[id(n)] = n
            for e in n.edges:
                target = self._target(e.src)
                if target is not None:
                    target.deps += 1
                    if id(target) not in seen:
                        stack.append(target)
        return list(seen.values())

    def _target(self, t: _T) -> _Node | None:
        if not t.rg:
            return None
        if t.node is not None:
            return t.node
        leaf = t.leaf
        if leaf is None or not leaf.trainable:
            return None
        if leaf.sink is None:
            sink = _Node(sys.maxsize, "AccumulateGrad", [])
            sink.leaf = leaf
            leaf.sink = sink
        return leaf.sink

    def _receive(self, n: _Node, slot: int, grad: _T, heap: list, tie: Any) -> None:
        """Put ``grad`` into ``n``'s input buffer (summing with what is there), then ready it when complete."""
        self.incref(grad.buf)
        held = n.buffer[slot]
        if held is None:
            n.buffer[slot] = grad
        else:                                   # gradients that meet are summed out of place
            total = _T(self._alloc(grad.nbytes, "temporaries", f"sum into {n.name}"), grad.numel, grad.item)
            self.incref(total.buf)
            self.decref(held.buf)
            self.decref(grad.buf)
            n.buffer[slot] = total
        n.deps -= 1
        if n.deps == 0:
            heapq.heappush(heap, (-n.seq, next(tie), n))

    def _run(self, n: _Node, heap: list, tie: Any) -> None:
        if n.leaf is not None:
            self._accumulate(n)
            return
        n.deps = -1
        incoming = n.buffer
        if n.region is not None and not n.region.recomputed and n.holders:
            self._recompute(n.region)
        grads: list[_T | None] = [None] * len(n.edges)
        if n.custom is not None:
            grads = n.custom(self, n, incoming)
        else:
            for i, e in enumerate(n.edges):      # pass-through gradients: the incoming one itself (or a view of it)
                if e.src.rg and e.mode in ("pass", "view"):
                    grads[i] = self.view(incoming[0], incoming[0].numel if e.mode == "pass" else e.src.numel)
            for i in n.order:
                e = n.edges[i]
                if e.src.rg and e.mode == "alloc":
                    grads[i] = self.new(e.src.numel, e.src.item, self._grad_kind(e.src), f"grad {n.name}")
                elif e.src.rg and e.mode == "alloc_out":   # in the output's shape and dtype: validate sums and casts
                    numel, item = n.out_numel, n.out_item
                    same = numel == e.src.numel and item == e.src.item
                    grads[i] = self.new(numel, item, self._grad_kind(e.src) if same else "temporaries",
                                        f"grad {n.name}")
        if n.holders:                            # checkpoint: the recomputed tensors die with the unpacked locals
            region = n.region
            region.pending -= 1
            if region.pending == 0:              # the last node that unpacks frees the frame: the block's kept
                for buf in region.sac[region.sac_next:]:   # input and what selective checkpointing stored
                    self.decref(buf)
                for t in region.inputs:
                    self.decref(t.buf)
                region.inputs = []
            for h in n.holders:
                buf = region.holders.pop(h, None)
                if buf is not None:
                    self.decref(buf)
        for i, e in enumerate(n.edges):          # validate_outputs: sum a broadcast gradient down, cast its dtype
            g = grads[i]
            if g is None:
                continue
            if g.numel != e.src.numel:
                s = self.new(e.src.numel, g.item, self._grad_kind(e.src) if g.item == e.src.item else "temporaries",
                             f"sum_to {n.name}")
                self.rel(g)
                g = s
            if g.item != e.src.item:
                c = self.new(e.src.numel, e.src.item, self._grad_kind(e.src), f"cast {n.name}")
                self.rel(g)
                g = c
            grads[i] = g
        n.buffer = [None] * n.slots
        for g in incoming:
            if g is not None:
                self.decref(g.buf)
        for buf in n.saved:
            self.decref(buf)
        n.saved = []
        for i, e in enumerate(n.edges):
            g = grads[i]
            target = self._target(e.src)
            if g is None:
                if target is not None:           # an undefined gradient still counts as delivered
                    target.deps -= 1
                    if target.deps == 0:
                        heapq.heappush(heap, (-target.seq, next(tie), target))
                continue
            if target is not None:
                self._receive(target, e.src.slot if e.src.node is not None else 0, g, heap, tie)
            self.rel(g)

    def _grad_kind(self, src: _T) -> str:
        leaf = src.leaf
        if leaf is not None and leaf.trainable and self.shard_grads and leaf.grad_kind == "gradients":
            return "comm_buffers"                # unsharded until the unit's reduce-scatter
        if leaf is not None and leaf.trainable and leaf.grad is None and self.micro == 0:
            return leaf.grad_kind
        return "temporaries"

    def _accumulate(self, n: _Node) -> None:
        """AccumulateGrad: the first gradient becomes ``param.grad``; later ones are added in place and freed."""
        leaf = n.leaf
        g = n.buffer[0]
        n.buffer = [None]
        if self.shard_grads and leaf.grad_kind == "gradients":   # ZeRO-2 / FSDP: whole until reduce-scattered
            self.retag(g.buf, "comm_buffers")
            self.pending_grads.setdefault(leaf.name, []).append(g.buf)
            return
        if leaf.grad is None:
            leaf.grad = g.buf
            self.retag(g.buf, leaf.grad_kind)
        else:
            self.decref(g.buf)

    def _recompute(self, region: _Region) -> None:
        """Non-reentrant checkpoint's recompute: rerun the region until everything it saved exists again."""
        region.recomputed = True
        outer_cache, outer_autocast = self.cache, self.autocast
        self.recomputing, self.scope = region, []
        self.cache = {} if region.autocast else None
        self.autocast = self.cache is not None
        region.sac_next = 0
        try:
            out = region.fn(self, region.inputs[0])
            self.rel(out)
        except _Stop:
            pass
        self.autocast_exit()
        scope, self.scope, self.recomputing = self.scope, None, None
        for t in reversed(scope):
            self.decref(t.buf)
        self.cache, self.autocast = outer_cache, outer_autocast

    def sac_output(self, numel: int, item: int, kind: str, label: str) -> _T:
        """A matmul's output under selective checkpointing: stored in forward, handed back in recompute."""
        region = self.recomputing or self.region
        if self.recomputing is not None and region.selective:
            buf = region.sac[region.sac_next]
            region.sac_next += 1
            t = _T(buf, numel, item)
            if self.scope is not None:
                self.scope.append(t)
            return t                              # the stored reference becomes the recompute's own
        t = self.new(numel, item, kind, label)
        if self.region is not None and self.region.selective:
            self.incref(t.buf)
            self.region.sac.append(t.buf)
        return t
