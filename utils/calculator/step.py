"""One training step, replayed: the model state, each micro-batch's forward (the family's) and backward, the
optimizer step. The engine part every family shares; what a family's model does is its module's.

The step's phases (``replay.Phase``): ``init`` (parameters, buffers, optimizer state, data-parallel buckets, the
batch), ``start`` (what the loop allocates before its first micro-batch), then per micro-batch ``m<i>.embed``,
``m<i>.f<layer>`` (each block's forward), ``m<i>.head`` and the family's loss phases, ``m<i>.exit`` (leaving
autocast), ``m<i>.bloss`` and ``m<i>.b<layer>`` (each block's backward), then ``optimizer`` and ``end``. Micro-batches
after the second repeat the second exactly (same state, same gradients alive), so two are replayed.
"""

from __future__ import annotations

from typing import Any, Callable

from . import registry
from .config import ModelConfig, TrainingSetup
from .data_parallel import _DataParallel
from .loss import _ChunkedLoss
from .ops import _Ops
from .optimizers import _optimizer_state_per_rank, _optimizer_temporaries, _shard_leaves
from .replay import _Buf, _Leaf, _Node, _Region, _Replay, _T


class _Step(_ChunkedLoss, _DataParallel, _Ops):
    """One step of a model and set-up, replayed op by op (``run``)."""

    def __init__(self, model: ModelConfig, setup: TrainingSetup, trace: bool = False) -> None:
        super().__init__(setup.device, trace)
        self.model, self.setup = model, setup
        self.family = registry.family_of(model.arch)
        self.leaves = {name: _Leaf(name, shape, self.family.leaf_item(name, setup), trainable)
                       for name, shape, trainable in self.family.parameter_shapes(model, setup)}
        self.held: dict[str, list[_T]] = {}           # the reader's variables that keep tensors alive (``hold``)
        self.graph_refs: list[_T] = []                 # what the autograd graph's nodes keep until it is freed
        self.first_rebind: dict[str, int] = {}         # variable -> index of the phase that first rebinds it

    # -- what the families use ---------------------------------------------------------------------------
    def p(self, name: str) -> _T:
        """The tensor of parameter ``name``."""
        return self.param(self.leaves[name])

    def run_layers(self, micro: int, x: _T, block: Callable[[int], Callable], extra: Callable[[int], list[_T]]) -> _T:
        """The blocks, one after another, checkpointed when the set-up says so: ``block(i)`` is block i's forward
        (a function of the replay and its input), ``extra(i)`` the other tensors it is given (kept by a checkpoint).
        A hook on each block's output marks where its backward begins."""
        ckpt = self.setup.checkpointing != "none"
        for layer in range(self.model.num_layers):
            self.set_phase(f"m{micro}.f{layer}")
            fn = block(layer)
            out = self.checkpointed(fn, x, *extra(layer)) if ckpt else fn(self, x)
            self.rel(x)
            x = out
            if x.node is not None:
                x.node.phase = f"m{micro}.b{layer}"
        return x

    def checkpointed(self, fn: Callable[[_Replay, _T], _T], x: _T, *extra: _T) -> _T:
        """``checkpoint(block, x, *extra, use_reentrant=False)`` (with notebook 03's policy when selective), or
        ``use_reentrant=True`` when the set-up says so."""
        if self.setup.reentrant:
            return self._reentrant(fn, x, extra)
        region = _Region(fn, [x, *extra], self.setup.checkpointing == "selective")
        region.autocast = self.autocast
        for t in region.inputs:                   # the checkpoint keeps its inputs for the recompute
            self.incref(t.buf)
        outer, self.region = self.region, region
        out = fn(self, x)
        self.region = outer
        return out

    def _reentrant(self, fn: Callable[[_Replay, _T], _T], x: _T, extra: tuple[_T, ...]) -> _T:
        """``CheckpointFunction``: the block runs without autograd; its output's node keeps the input (and the
        block's other arguments); its backward detaches the input, recomputes the whole block under the forward's
        autocast, runs ``torch.autograd.backward(output, grad)`` and returns the input's ``.grad``."""
        autocast = self.autocast
        grad_was, self.grad_enabled = self.grad_enabled, False
        out = fn(self, x)
        self.grad_enabled = grad_was
        n = self.node("CheckpointFunctionBackward", [(x, "custom")], saved=[x])
        self.output(out, n)
        if n is None:
            return out
        for t in extra:                       # ctx.run_function's arguments live until the graph is freed
            self.incref(t.buf)
            self.graph_refs.append(t)

        def backward(r: _Replay, node: _Node, incoming: list) -> list:
            leaf = _Leaf("checkpoint's detached input", (x.numel,), x.item, True, grad_kind="temporaries")
            detached = _T(x.buf, x.numel, x.item, True, None, 0, leaf)    # x.detach(): the same storage
            r.incref(x.buf)
            leaf.tensor = detached
            outer_cache, outer_autocast = r.cache, r.autocast
            r.cache, r.autocast = ({} if autocast else None), autocast
            recomputed = fn(r, detached)
            r.autocast_exit()                            # the recompute's `with autocast` exits
            r.cache, r.autocast = outer_cache, outer_autocast
            if recomputed.node is not None:
                r.backward(recomputed, grad=incoming[0])
            grad = None
            if leaf.grad is not None:
                grad = _T(leaf.grad, x.numel, x.item)
                leaf.grad = None
            r.rel(recomputed, detached)                  # the backward's locals go when it returns
            return [grad]

        n.custom = backward
        return out

    def hold(self, key: str, tensors: list[_T]) -> None:
        """The reader's variable ``key`` now refers to ``tensors``: what it held before goes (a rebinding)."""
        for t in tensors:
            self.incref(t.buf)
        previous = self.held.pop(key, [])
        self.held[key] = tensors
        self.first_rebind.setdefault(key, len(self.phases))
        for t in previous:
            self.decref(t.buf)

    def backward_loss(self, micro: int, loss: _T, divide: bool = True) -> None:
        """``(loss / accumulation_steps).backward()`` (the division is skipped where ``divide`` is False)."""
        self.set_phase(f"m{micro}.bloss")
        scaled = self.div_scalar(loss, "loss / accumulation_steps") if divide else self.view(loss)
        self.backward(scaled)
        self.after_backward()
        self.family.after_backward(self, micro)
        self.free_graph()
        self.rel(scaled, loss)

    def free_graph(self) -> None:
        """What the autograd graph's nodes keep (``graph_refs``: a leaf made for checkpointing and its ``.grad``,
        reentrant checkpoints' arguments) goes with the graph: when backward returns, or, while the loop's variables
        hold an output of this forward (the loss, the logits: their ``grad_fn`` keeps the whole graph), when those
        are rebound."""
        holders = [key for key in ("loss", "outputs") if key in self.held]
        if holders and self.family.outputs(self.setup) != "dropped":
            self.held[holders[0]].extend(self.graph_refs)     # the variable rebound last frees it
        else:
            for t in self.graph_refs:
                self.decref(t.buf)
        self.graph_refs = []

    # -- the whole step ------------------------------------------------------------------------------------
    def prologue(self) -> None:
        """What exists before the step: parameters, buffers, optimizer state, DDP's buckets, the batch."""
        model, setup = self.model, self.setup
        self.gathered: dict[int, _Buf] = {}
        self.pending_grads: dict[str, list[_Buf]] = {}
        self.param_shards = setup.ranks if setup.strategy == "fsdp" else 1
        self.shard_grads = setup.strategy in ("zero2", "fsdp")
        for leaf in self.leaves.values():
            self.param(leaf)
        self.family.buffers(self)
        self.state_buf = self._alloc(_optimizer_state_per_rank(model, setup), "optimizer_state", "optimizer state")
        self.incref(self.state_buf)
        if setup.strategy in ("ddp", "zero1"):  # DDP's gradient buckets (gradient_as_bucket_view=False)
            buckets = sum(leaf.numel * leaf.item for leaf in self.leaves.values() if leaf.trainable)
            self.incref(self._alloc(buckets, "comm_buffers", "DDP gradient buckets"))
        arrays = self.family.batch_arrays(setup)
        batch = self._alloc(arrays * 8 * setup.tokens * setup.accumulation_steps, "inputs", "token ids and targets")
        self.incref(batch)
        self.baseline = self.current

    def optimizer_temporaries(self) -> None:
        """What one steady-state ``optimizer.step()`` allocates and frees (its state exists already)."""
        trainable = [leaf for leaf in self.leaves.values() if leaf.trainable]
        _optimizer_temporaries(self, _shard_leaves(trainable, self.setup), self.setup)

    def run(self) -> "_Step":
        setup = self.setup
        self.prologue()
        self.set_phase("start")
        self.family.step_begin(self)
        for micro in range(min(setup.accumulation_steps, 2)):
            self.micro = micro
            self.set_phase(f"m{micro}.embed")
            if setup.precision == "bf16-autocast":
                self.autocast, self.cache = True, {}
            loss = self.family.forward(self, micro)
            self.set_phase(f"m{micro}.exit")
            if self.autocast:
                self.autocast_exit()
            self.backward_loss(micro, loss, divide=self.family.divides_loss(setup))
        self.grads_mark = self.current            # what is alive when optimizer.step() begins
        self.grads_at_step = self.by_kind["gradients"]
        self.set_phase("optimizer")
        self.optimizer_temporaries()
        for leaf in self.leaves.values():        # zero_grad(set_to_none=True)
            if leaf.trainable and leaf.grad is not None:
                self.decref(leaf.grad)
                leaf.grad = None
        self.set_phase("end")
        if self.family.outputs(setup) == "kept-in-step":   # the step function returns: its variables go
            for key in list(self.held):
                for t in self.held.pop(key):
                    self.decref(t.buf)
        self.finish()
        return self

    def held_bytes(self) -> dict[str, tuple[int, dict[str, int], dict[int, dict[str, int]]]]:
        """Variable -> (index of the phase that first rebinds it, its bytes by kind, and those by block tag), of
        what the loop's variables hold when the step ends (what the next step begins with, under ``"kept"``)."""
        out = {}
        for key, tensors in self.held.items():
            by_kind: dict[str, int] = {}
            by_tag: dict[int, dict[str, int]] = {}
            for buf in {id(t.buf): t.buf for t in tensors}.values():
                by_kind[buf.kind] = by_kind.get(buf.kind, 0) + buf.nbytes
                if buf.tag is not None:
                    tagged = by_tag.setdefault(buf.tag, {})
                    tagged[buf.kind] = tagged.get(buf.kind, 0) + buf.nbytes
            out[key] = (self.first_rebind[key], by_kind, by_tag)
        return out
