"""A training-memory calculator: the peak bytes of a training step per device, term by term, checked by measuring.

Introduced in notebook 12 (distributed), which prints its 7B and 70B tables; notebook 15 (capstone) predicts
its model with it before measuring. As a program::

    python -m utils.calculator --preset 7B                     # Llama-2-7B, micro-batch 1 x 4096, bf16 autocast
    python -m utils.calculator --preset 70B --strategy fsdp --ranks 64 --checkpointing every_block
    python -m utils.calculator --layers 12 --d-model 768 --heads 12 --vocab 50257 --arch gpt --seq-len 1024
    python -m utils.calculator --validate [--check]            # the measured grid: prediction vs exact tracker

What it predicts. From a transformer's shape (``ModelConfig``; ``PRESETS`` holds Llama 3.2 1B and Llama 2
7B, 13B and 70B) and a training set-up (``TrainingSetup``: precision, optimizer and its torch.optim
implementation, activation checkpointing, LoRA, chunked loss, accumulation, data parallelism),
``predict`` returns a ``MemoryBreakdown``: the peak bytes of one steady-state training step on one device,
what is alive at that moment (parameters, gradients, optimizer state, activations, the loss and its logits,
autocast's weight copies, data-parallel buffers, the batch, temporaries) and each term at its own largest.
``largest_micro_batch`` finds the largest micro-batch whose peak fits a device; ``format_table`` prints a
breakdown.

How. Each term is a formula of the shapes (bytes per parameter, notebook 01; saved activations, 03;
autocast's copies, 04; the loss's logits, 08; optimizer state, 09; ZeRO's shards, 11), but the peak depends
on *when* each tensor lives. So the calculator replays one step of a plain eager training loop
(``reference_step``) as the sequence of tensor allocations and frees eager PyTorch performs: each forward op
allocates its output and keeps what its backward needs; backward runs autograd's nodes in its order
(highest sequence number first), allocating gradients, freeing what each node saved, summing gradients that
meet, casting them back to their inputs' dtype; non-reentrant checkpointing drops a block's saved tensors in
forward and recomputes the block when its backward begins (selective: notebook 03's policy, matmul outputs
kept); the optimizer's temporaries follow torch.optim's for-loop, foreach and fused code (and
``utils.AdamW8bit``'s). Every event's size is a product of the shapes, and the peak is the replay's highest
point. Two block designs are replayed: ``"gpt"`` (``utils.TinyTransformer``) and ``"llama"`` (Hugging Face's
Llama, written out as ``llama_like``: fp32 RMSNorm, rotary embeddings, ``repeat_kv``, SwiGLU).

Exactness (``validate``): on the CPU the exact tracker (``utils.measure_memory``) measures the same step on
small models of both designs over a grid of 38 configurations that covers every option, and the prediction
equals the measurement **to the byte** for every term (parameters, optimizer state, batch, activations, loss,
gradients), for the peak, and for the bytes alive at every phase boundary: the bound is 0 bytes, on torch
2.13 and 2.11, and the tests assert it on an 11-configuration subset. What that bound does not cover:

* a GPU: the caching allocator rounds each block up to 512 bytes and keeps cuBLAS workspaces, and CUDA's
  attention kernels save slightly different statistics (logsumexp padding, RNG state). ``validate(device=
  "cuda")`` / ``--validate --on cuda`` measures that difference with the allocator; **it has not been run
  on a GPU yet**. The CUDA context and fragmentation (``max_memory_reserved``) are outside every term;
* data parallelism across processes: each rank's parameters, gradients and optimizer state follow ZeRO's
  formulas (equal to ``utils.parallel.predict_zero_bytes_per_rank``, tested; FSDP2 pads dim 0 of each
  tensor, up to one row per tensor more), DDP's gradient buckets are measured on one in-process rank
  (tested); FSDP's all-gathered units (two at a time) and unsharded gradients before their
  reduce-scatter follow FSDP2's design and are not measured here. With ``"bf16-autocast"`` and FSDP the
  replay keeps autocast's bf16 copy of every gathered weight until its backward, as plain ``torch.autocast``
  does; FSDP2's ``MixedPrecisionPolicy`` is not modelled;
* other models, ``torch.compile``'d steps and fused kernels (flash attention variants, Liger): the replay
  knows the ops of the two designs above, run eagerly.
"""

from __future__ import annotations

import argparse
import heapq
import itertools
import math
import sys
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Iterable, Sequence

from .checks import positive_int

ARCHS = ("gpt", "llama")
PRECISIONS = ("fp32", "bf16-autocast", "bf16")
OPTIMIZERS = ("sgd", "sgd_momentum", "adam", "adamw", "adafactor", "adamw8bit")
OPTIMIZER_IMPLS = ("for-loop", "foreach", "fused")
CHECKPOINTING = ("none", "every_block", "selective")
LORA_TARGETS = ("all", "attention")
STRATEGIES = ("single", "ddp", "zero1", "zero2", "fsdp")
DEVICES = ("cuda", "cpu")
KINDS = ("parameters", "gradients", "optimizer_state", "activations", "loss", "weight_copies", "comm_buffers",
         "inputs", "temporaries")


def _choice(name: str, value: Any, allowed: tuple[str, ...]) -> str:
    if value not in allowed:
        raise ValueError(f"{name} must be one of {allowed}, got {value!r}")
    return value


# --- what the reader describes ------------------------------------------------------------------------------

@dataclass(frozen=True)
class ModelConfig:
    """The shape of a decoder-only transformer.

    Two block designs are modelled, each exactly as this module's reference step trains it:

    * ``"gpt"``: ``utils.TinyTransformer`` (learned position embeddings, pre-norm LayerNorm with
      bias, a fused qkv Linear, GELU MLP ``ffn_width`` wide, biases everywhere, an untied head with
      bias, attention through ``F.scaled_dot_product_attention``).
    * ``"llama"``: Llama's design as Hugging Face writes it (RMSNorm computed in float32, rotary
      position embeddings, separate q/k/v/o projections with ``num_kv_heads`` key/value heads
      (grouped-query attention, the key/value heads repeated before attention), a SwiGLU MLP, no
      biases; the head tied to the embedding or not).

    Attributes:
        num_layers: transformer blocks.
        d_model: width of the residual stream.
        num_heads: query heads; must divide ``d_model``.
        vocab_size: tokens in the vocabulary (rows of the embedding and the head).
        ffn_width: hidden width of the MLP (None: ``4 * d_model``).
        num_kv_heads: key/value heads (None: ``num_heads``); must divide ``num_heads``. ``"gpt"``
            needs ``num_kv_heads == num_heads``.
        max_seq_len: longest sequence: the position table's rows for ``"gpt"``; the published context
            length for ``"llama"``.
        arch: ``"gpt"`` or ``"llama"``.
        tied_embeddings: the head shares the embedding's weight (``"llama"`` only; Llama 3.2 1B).
        name: a label for tables.

    Raises:
        ValueError: non-positive sizes, heads that do not divide the width, key/value heads that do
            not divide the heads, an unknown ``arch``.

    Example:
        >>> gpt2_small = ModelConfig(num_layers=12, d_model=768, num_heads=12, vocab_size=50257, max_seq_len=1024)
        >>> count_parameters(gpt2_small)          # GPT-2 small's shape, with an untied head
    """

    num_layers: int
    d_model: int
    num_heads: int
    vocab_size: int
    ffn_width: int | None = None
    num_kv_heads: int | None = None
    max_seq_len: int = 2048
    arch: str = "gpt"
    tied_embeddings: bool = False
    name: str = "custom"

    def __post_init__(self) -> None:
        for name in ("num_layers", "d_model", "num_heads", "vocab_size", "max_seq_len"):
            positive_int(name, getattr(self, name))
        _choice("arch", self.arch, ARCHS)
        if self.ffn_width is not None:
            positive_int("ffn_width", self.ffn_width)
        if self.num_kv_heads is not None:
            positive_int("num_kv_heads", self.num_kv_heads)
        if self.d_model % self.num_heads:
            raise ValueError(f"num_heads ({self.num_heads}) must divide d_model ({self.d_model}): expected a head "
                             f"count such as {_divisors_near(self.d_model, self.num_heads)}")
        if self.kv_heads > self.num_heads or self.num_heads % self.kv_heads:
            raise ValueError(f"num_kv_heads ({self.kv_heads}) must divide num_heads ({self.num_heads}): each key/value "
                             "head serves a whole group of query heads")
        if self.arch == "gpt" and self.kv_heads != self.num_heads:
            raise ValueError("arch 'gpt' (utils.TinyTransformer) has one key/value head per query head: expected "
                             f"num_kv_heads None or {self.num_heads}, got {self.num_kv_heads}")
        if self.tied_embeddings and self.arch != "llama":
            raise ValueError("tied_embeddings is modelled for arch 'llama' only (utils.TinyTransformer's head is untied)")
        if not isinstance(self.name, str) or not self.name:
            raise ValueError(f"name must be a non-empty string, got {self.name!r}")

    @property
    def ffn(self) -> int:
        """The MLP's hidden width."""
        return self.ffn_width if self.ffn_width is not None else 4 * self.d_model

    @property
    def kv_heads(self) -> int:
        """Key/value heads."""
        return self.num_kv_heads if self.num_kv_heads is not None else self.num_heads

    @property
    def head_dim(self) -> int:
        """Width of one attention head."""
        return self.d_model // self.num_heads


def _divisors_near(width: int, heads: int) -> str:
    near = sorted((d for d in range(1, min(width, 4 * heads) + 1) if width % d == 0), key=lambda d: abs(d - heads))
    return " or ".join(str(d) for d in sorted(near[:3]))


@dataclass(frozen=True)
class TrainingSetup:
    """How the model is trained: one optimizer step of ``accumulation_steps`` micro-batches per device.

    Attributes:
        micro_batch: sequences per micro-batch per device.
        seq_len: tokens per sequence.
        precision: ``"fp32"``; ``"bf16-autocast"`` (fp32 weights, which are the master weights, and fp32
            gradients and optimizer state; matmuls and their saved activations in bf16 under
            ``torch.autocast``, which caches a bf16 copy of each trainable weight during forward);
            ``"bf16"`` (pure bf16: the model, its gradients and torch.optim's state in bf16, the loss
            computed on ``logits.float()``).
        optimizer: ``"sgd"``, ``"sgd_momentum"``, ``"adam"``, ``"adamw"``, ``"adafactor"``
            (``torch.optim.Adafactor``), ``"adamw8bit"`` (``utils.AdamW8bit`` of notebook 09).
        optimizer_impl: torch.optim's implementation: ``"foreach"`` (CUDA's default: a temporary the
            size of all parameters of a group), ``"for-loop"`` (the CPU's default: temporaries of one
            or two tensors at a time), ``"fused"`` (none; SGD, Adam and AdamW only).
        checkpointing: ``"none"``, ``"every_block"`` (each block under non-reentrant
            ``torch.utils.checkpoint``), ``"selective"`` (notebook 03's policy: matmul outputs saved,
            everything else recomputed).
        lora_rank: 0 trains every parameter; r > 0 freezes the model and trains LoRA adapters of rank r
            (A: r x in, B: out x r, scale alpha / r) on ``lora_targets``.
        lora_targets: ``"all"`` (every Linear inside the blocks) or ``"attention"`` (the attention
            projections only).
        chunked_loss: 0 computes ``F.cross_entropy`` on the whole logits; c > 0 uses
            ``utils.chunked_cross_entropy`` with c tokens per chunk (notebook 08).
        accumulation_steps: micro-batches per optimizer step (notebook 02).
        strategy: ``"single"`` (one device), ``"ddp"``, ``"zero1"``, ``"zero2"``, ``"fsdp"`` (ZeRO-3,
            FSDP2's ``fully_shard`` per block).
        ranks: data-parallel ranks (1 for ``"single"``, at least 2 otherwise).
        device: ``"cuda"`` or ``"cpu"``: the few op-level details that differ (pure bf16 LayerNorm
            statistics are bf16 on the CPU, fp32 on CUDA).

    Raises:
        ValueError: an unknown choice, a non-positive size, a strategy that needs more ranks than
            given, a ``"fused"`` optimizer torch does not fuse.

    Example:
        >>> TrainingSetup(micro_batch=4, seq_len=2048, checkpointing="every_block", lora_rank=16)
        >>> TrainingSetup(seq_len=4096, strategy="fsdp", ranks=64, optimizer_impl="fused")
    """

    micro_batch: int = 1
    seq_len: int = 2048
    precision: str = "bf16-autocast"
    optimizer: str = "adamw"
    optimizer_impl: str = "foreach"
    checkpointing: str = "none"
    lora_rank: int = 0
    lora_targets: str = "all"
    chunked_loss: int = 0
    accumulation_steps: int = 1
    strategy: str = "single"
    ranks: int = 1
    device: str = "cuda"

    def __post_init__(self) -> None:
        positive_int("micro_batch", self.micro_batch, "sequences per device")
        positive_int("seq_len", self.seq_len, "tokens per sequence")
        positive_int("accumulation_steps", self.accumulation_steps)
        positive_int("ranks", self.ranks)
        for name, allowed in [("precision", PRECISIONS), ("optimizer", OPTIMIZERS), ("optimizer_impl", OPTIMIZER_IMPLS),
                              ("checkpointing", CHECKPOINTING), ("lora_targets", LORA_TARGETS),
                              ("strategy", STRATEGIES), ("device", DEVICES)]:
            _choice(name, getattr(self, name), allowed)
        for name in ("lora_rank", "chunked_loss"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"{name} must be an int >= 0 (0 turns it off), got {value!r}")
        if self.strategy == "single" and self.ranks != 1:
            raise ValueError(f"strategy 'single' trains on one device: expected ranks=1, got {self.ranks} (pick 'ddp', "
                             "'zero1', 'zero2' or 'fsdp' for several)")
        if self.strategy != "single" and self.ranks < 2:
            raise ValueError(f"strategy {self.strategy!r} needs at least 2 ranks to replicate or shard over, got "
                             f"ranks={self.ranks} (use strategy 'single' for one device)")
        if self.optimizer_impl == "fused" and self.optimizer not in ("sgd", "sgd_momentum", "adam", "adamw"):
            raise ValueError(f"torch.optim has no fused {self.optimizer!r}: expected optimizer_impl 'for-loop' or "
                             "'foreach' (fused exists for sgd, sgd_momentum, adam, adamw)")
        if self.optimizer == "adamw8bit" and self.optimizer_impl != "for-loop":
            raise ValueError("utils.AdamW8bit updates one tensor at a time: expected optimizer_impl 'for-loop' "
                             f"with optimizer 'adamw8bit', got {self.optimizer_impl!r}")

    @property
    def tokens(self) -> int:
        """Tokens per micro-batch per device."""
        return self.micro_batch * self.seq_len


# --- the replay: tensors, autograd nodes, the backward engine ------------------------------------------------

class _Buf:
    """One storage: its bytes, what it is (a ``KINDS`` entry) and how many references keep it alive."""

    __slots__ = ("nbytes", "kind", "label", "refs")

    def __init__(self, nbytes: int, kind: str, label: str) -> None:
        self.nbytes, self.kind, self.label, self.refs = nbytes, kind, label, 0


class _Leaf:
    """A parameter: its shape, bytes per element, whether it trains, and its gradient once it has one."""

    __slots__ = ("name", "shape", "item", "trainable", "grad", "tensor", "sink")

    def __init__(self, name: str, shape: tuple[int, ...], item: int, trainable: bool) -> None:
        self.name, self.shape, self.item, self.trainable = name, shape, item, trainable
        self.grad: _Buf | None = None
        self.tensor: _T | None = None
        self.sink: _Node | None = None        # its AccumulateGrad node while a backward runs

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
        self.phase = "start"
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

    # -- storage bookkeeping
    def _alloc(self, nbytes: int, kind: str, label: str) -> _Buf:
        buf = _Buf(nbytes, kind, label)
        if nbytes:
            self.current += nbytes
            self.by_kind[kind] += nbytes
            self.largest[kind] = max(self.largest[kind], self.by_kind[kind])
            if self.trace is not None:
                self.trace.append((self.phase, nbytes, label))
            if self.current > self.peak:
                self.peak, self.peak_kinds, self.peak_phase = self.current, dict(self.by_kind), self.phase
        return buf

    def incref(self, buf: _Buf) -> None:
        buf.refs += 1

    def decref(self, buf: _Buf) -> None:
        buf.refs -= 1
        if buf.refs == 0 and buf.nbytes:
            self.current -= buf.nbytes
            self.by_kind[buf.kind] -= buf.nbytes
            if self.trace is not None:
                self.trace.append((self.phase, -buf.nbytes, "free " + buf.label))
        elif buf.refs < 0:  # pragma: no cover - a bug in the replay, not in the input
            raise AssertionError(f"{buf.label} released more often than referenced")

    def set_phase(self, phase: str) -> None:
        self.phase_marks[self.phase] = self.current
        self.phase = phase

    def retag(self, buf: _Buf, kind: str) -> None:
        """Count a live storage as another kind from now on (a gradient autograd hands to a parameter)."""
        if buf.refs > 0:
            self.by_kind[buf.kind] -= buf.nbytes
            self.by_kind[kind] += buf.nbytes
            self.largest[kind] = max(self.largest[kind], self.by_kind[kind])
        buf.kind = kind

    # -- tensors held by Python
    def new(self, numel: int, item: int, kind: str, label: str, rg: bool = False) -> _T:
        """A fresh tensor with one Python reference."""
        t = _T(self._alloc(numel * item, kind, label), numel, item, rg)
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
    def backward(self, root: _T) -> None:
        """``root.backward()``: run every node that leads to a trainable parameter, in autograd's order."""
        seed = self.new(root.numel, root.item, "temporaries", "grad seed")
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
        if leaf is not None and leaf.trainable and self.shard_grads:
            return "comm_buffers"                # unsharded until the unit's reduce-scatter
        if leaf is not None and leaf.trainable and leaf.grad is None and self.micro == 0:
            return "gradients"
        return "temporaries"

    def _accumulate(self, n: _Node) -> None:
        """AccumulateGrad: the first gradient becomes ``param.grad``; later ones are added in place and freed."""
        leaf = n.leaf
        g = n.buffer[0]
        n.buffer = [None]
        if self.shard_grads:                     # ZeRO-2 / FSDP: held whole until its unit is reduce-scattered
            self.retag(g.buf, "comm_buffers")
            self.pending_grads.setdefault(leaf.name, []).append(g.buf)
            return
        if leaf.grad is None:
            leaf.grad = g.buf
            self.retag(g.buf, "gradients")
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



class _Ops(_Replay):
    """The aten ops of the reference step, each with its forward allocations and its autograd record."""

    def act_item(self, *inputs: _T) -> int:
        """Bytes per element of a matmul's output: bf16 under autocast, else the inputs' dtype."""
        return 2 if self.autocast else max(t.item for t in inputs)

    def linear(self, x: _T, w: _T, b: _T | None, out_features: int, label: str) -> _T:
        """``F.linear`` on (tokens, in) rows: ``addmm`` with a bias, ``mm`` without; autocast casts b, W, x."""
        rows = x.numel // (w.numel // out_features)
        casts = []
        if self.autocast:
            bc = self.cast16(b, f"{label}.bias bf16") if b is not None else None
            wc = self.cast16(w, f"{label}.weight bf16")
            xc = self.cast16(x, f"{label} input bf16")
            casts = [t for t in (bc, wc, xc) if t is not None]
        else:
            bc, wc, xc = (self.view(b) if b is not None else None), self.view(w), self.view(x)
            casts = [t for t in (bc, wc, xc) if t is not None]
        item = self.act_item(xc, wc)
        saved = ([xc] if wc.rg else []) + ([wc] if xc.rg else [])
        if bc is not None:
            n = self.node(f"AddmmBackward {label}", [(bc, "pass"), (xc, "alloc"), (wc, "alloc")], order=[1, 2],
                          saved=saved)
        else:
            n = self.node(f"MmBackward {label}", [(xc, "alloc"), (wc, "alloc")], order=[1, 0], saved=saved)
        out = self.sac_output(rows * out_features, item, "activations", label)
        self.output(out, n)
        self.rel(*casts)
        return out

    def layer_norm(self, x: _T, w: _T, b: _T, width: int, label: str) -> _T:
        """``F.layer_norm``: output, mean and rstd (bf16 statistics for bf16 input on the CPU, else fp32)."""
        rows = x.numel // width
        stat = 2 if (x.item == 2 and self.device == "cpu") else 4
        n = self.node(f"LayerNormBackward {label}", [(x, "alloc"), (w, "alloc"), (b, "alloc")], saved=[x, w, b])
        out = self.new(x.numel, x.item, "activations", label)
        mean = self.new(rows, stat, "activations", f"{label} mean")
        rstd = self.new(rows, stat, "activations", f"{label} rstd")
        self.save(n, mean, rstd)
        self.output(out, n)
        self.rel(mean, rstd)
        return out

    def add(self, a: _T, b: _T, label: str, numel: int | None = None) -> _T:
        n = self.node(f"AddBackward {label}", [(a, "pass"), (b, "pass")])
        return self.output(self.new(numel or max(a.numel, b.numel), max(a.item, b.item), "activations", label), n)

    def mul_scalar(self, x: _T, label: str) -> _T:
        n = self.node(f"MulBackward {label}", [(x, "alloc")])
        return self.output(self.new(x.numel, x.item, "activations", label), n)

    def gelu(self, x: _T, label: str) -> _T:
        n = self.node(f"GeluBackward {label}", [(x, "alloc")], saved=[x])
        return self.output(self.new(x.numel, x.item, "activations", label), n)

    def split3(self, x: _T, label: str) -> tuple[_T, _T, _T]:
        """``qkv.split(d, dim=-1)``: three views; backward concatenates their gradients (``cat``)."""
        n = self.node(f"SplitBackward {label}", [(x, "alloc")], slots=3)
        parts = []
        for slot in range(3):
            v = self.view(x, x.numel // 3)
            parts.append(self.output(v, n, slot) if n is not None else self.output(v, None))
        if n is not None:
            def cat(r: _Replay, node: _Node, incoming: list) -> list:
                return [r.new(x.numel, x.item, "temporaries", f"cat {label}")]
            n.custom = cat
        return parts[0], parts[1], parts[2]

    def sdpa(self, q: _T, k: _T, v: _T, lse_numel: int, label: str) -> _T:
        """``F.scaled_dot_product_attention(causal)``, flash kernel: output and fp32 logsumexp are saved."""
        casts = []
        if self.autocast:
            v, k, q = (self.cast16(t, f"{label} {name} bf16") for t, name in ((v, "value"), (k, "key"), (q, "query")))
            casts = [v, k, q]
        n = self.node(f"SdpaBackward {label}", [(q, "alloc"), (k, "alloc"), (v, "alloc")], saved=[q, k, v])
        out = self.new(q.numel, q.item, "activations", label)
        lse = self.new(lse_numel, 4, "activations", f"{label} logsumexp")
        self.save(n, lse, out)
        self.output(out, n)
        self.rel(*casts)
        self.rel(lse)
        return out

    def embedding(self, w: _T, numel: int, label: str, indices: _T | None = None) -> _T:
        n = self.node(f"EmbeddingBackward {label}", [(w, "alloc")], saved=[indices] if indices is not None else [])
        return self.output(self.new(numel, w.item, "activations", label), n)

    def to_float(self, x: _T, label: str, kind: str = "loss", item: int = 4) -> _T:
        """``x.float()`` (or ``x.to(dtype)``): the same tensor when it has the dtype already, else a copy."""
        if x.item == item:
            return self.view(x)
        n = self.node(f"ToCopyBackward {label}", [(x, "alloc")])
        return self.output(self.new(x.numel, item, kind, label), n)

    def mul(self, a: _T, b: _T, label: str, numel: int | None = None) -> _T:
        """``a * b`` of tensors (with broadcasting and type promotion); saves each factor the other's grad needs."""
        item, numel = max(a.item, b.item), numel or max(a.numel, b.numel)
        n = self.node(f"MulBackward {label}", [(a, "alloc_out"), (b, "alloc_out")], order=[1, 0],
                      saved=([b] if a.rg else []) + ([a] if b.rg else []))
        if n is not None:
            n.out_item, n.out_numel = item, numel
        return self.output(self.new(numel, item, "activations", label), n)

    def unary(self, x: _T, name: str, label: str, *, save_input: bool = False, save_output: bool = False,
              temps: int = 0, numel: int | None = None, grad_numel: int | None = None) -> _T:
        """An elementwise op; its backward allocates ``temps`` temporaries (freed) before the gradient."""
        n = self.node(f"{name}Backward {label}", [(x, "custom")], saved=[x] if save_input else [])
        out = self.output(self.new(numel or x.numel, x.item, "activations", label), n)
        self.save(n, *([out] if save_output else []))
        if n is not None:
            size = grad_numel or out.numel

            def backward(r: _Replay, node: _Node, incoming: list) -> list:
                scratch = [r.new(size, x.item, "temporaries", f"{name} backward scratch") for _ in range(temps)]
                grad = r.new(x.numel, x.item, r._grad_kind(x), f"grad {name}")
                r.rel(*reversed(scratch))
                return [grad]
            n.custom = backward
        return out

    def slice_half(self, x: _T, label: str) -> _T:
        """``x[..., :h]`` or ``x[..., h:]``: a view; its backward writes into a zero tensor of x's size."""
        n = self.node(f"SliceBackward {label}", [(x, "alloc")])
        return self.output(self.view(x, x.numel // 2), n)

    def neg(self, x: _T, label: str) -> _T:
        n = self.node(f"NegBackward {label}", [(x, "alloc")])
        return self.output(self.new(x.numel, x.item, "activations", label), n)

    def cat2(self, a: _T, b: _T, label: str) -> _T:
        """``torch.cat((a, b), -1)``: backward hands each input a view of the gradient."""
        n = self.node(f"CatBackward {label}", [(a, "view"), (b, "view")])
        return self.output(self.new(a.numel + b.numel, max(a.item, b.item), "activations", label), n)

    def reshape_copy(self, x: _T, label: str, copy_grad: bool) -> _T:
        """``.view(...).transpose(1, 2)`` of a projection's output: a view; reshaping its gradient back copies
        it when the gradient arrives non-contiguous (``copy_grad``)."""
        if not copy_grad:
            return self.view(x)
        n = self.node(f"ViewBackward {label}", [(x, "alloc")])
        return self.output(self.view(x), n)

    def repeat_kv(self, x: _T, n_rep: int, label: str) -> _T:
        """Hugging Face's ``repeat_kv``: expand then reshape, a copy; backward sums the copies back (sum_to)."""
        if n_rep == 1:
            return self.view(x)
        n = self.node(f"RepeatKvBackward {label}", [(x, "alloc")])
        if self.model.kv_heads == 1:           # (B, 1, n_rep, T, hd) expanded reshapes to a view: no copy
            return self.output(self.view(x, x.numel * n_rep), n)
        return self.output(self.new(x.numel * n_rep, x.item, "activations", label), n)

    def add_scalar(self, x: _T, label: str) -> _T:
        n = self.node(f"AddBackward {label}", [(x, "pass")])
        return self.output(self.new(x.numel, x.item, "activations", label), n)

    def cross_entropy(self, logits: _T, tokens: int) -> _T:
        """``F.cross_entropy`` = log_softmax (saves its output) + nll_loss (saves total_weight)."""
        n = self.node("LogSoftmaxBackward", [(logits, "alloc")])
        lsm = self.output(self.new(logits.numel, logits.item, "loss", "log-probs"), n)
        self.save(n, lsm)
        n = self.node("NllLossBackward", [(lsm, "alloc")], saved=[lsm])
        loss = self.new(1, logits.item, "loss", "loss")
        total_weight = self.new(1, logits.item, "loss", "total_weight")
        self.save(n, total_weight)
        self.output(loss, n)
        self.rel(lsm, total_weight)
        return loss

    def div_scalar(self, x: _T, label: str) -> _T:
        n = self.node(f"DivBackward {label}", [(x, "alloc")])
        return self.output(self.new(x.numel, x.item, "loss", label), n)


# --- the model's parameters, in ``model.parameters()`` order --------------------------------------------------

def _linears(model: ModelConfig) -> list[tuple[str, int, int, bool]]:
    """A block's Linear layers: (name, in_features, out_features, attention?)."""
    d, f = model.d_model, model.ffn
    if model.arch == "gpt":
        return [("qkv", d, 3 * d, True), ("proj", d, d, True), ("mlp.0", d, f, False), ("mlp.2", f, d, False)]
    kv = model.kv_heads * model.head_dim
    return [("self_attn.q_proj", d, d, True), ("self_attn.k_proj", d, kv, True), ("self_attn.v_proj", d, kv, True),
            ("self_attn.o_proj", d, d, True), ("mlp.gate_proj", d, f, False), ("mlp.up_proj", d, f, False),
            ("mlp.down_proj", f, d, False)]


def _lora_on(setup: TrainingSetup, attention: bool) -> bool:
    return setup.lora_rank > 0 and (setup.lora_targets == "all" or attention)


def parameter_shapes(model: ModelConfig, setup: TrainingSetup | None = None) -> list[tuple[str, tuple[int, ...], bool]]:
    """Every parameter as (name, shape, trainable), in the order ``model.parameters()`` yields them.

    With LoRA (``setup.lora_rank > 0``) the base weights are frozen and each targeted Linear gains
    ``lora_a`` (rank, in) and ``lora_b`` (out, rank), trainable.

    Example:
        >>> sum(math.prod(s) for _, s, _ in parameter_shapes(PRESETS["7B"]))
        6738415616
    """
    setup = setup or TrainingSetup()
    lora = setup.lora_rank > 0
    out: list[tuple[str, tuple[int, ...], bool]] = []
    d, v = model.d_model, model.vocab_size
    out.append(("token_embedding.weight" if model.arch == "gpt" else "embed_tokens.weight", (v, d), not lora))
    if model.arch == "gpt":
        out.append(("position_embedding.weight", (model.max_seq_len, d), not lora))
    for layer in range(model.num_layers):
        prefix = f"blocks.{layer}." if model.arch == "gpt" else f"layers.{layer}."
        linears = {name: (fan_in, fan_out, att) for name, fan_in, fan_out, att in _linears(model)}

        def linear(name: str) -> None:
            fan_in, fan_out, att = linears[name]
            if _lora_on(setup, att):                # LoRALinear's own parameters come before its base's
                out.append((prefix + name + ".lora_a", (setup.lora_rank, fan_in), True))
                out.append((prefix + name + ".lora_b", (fan_out, setup.lora_rank), True))
            out.append((prefix + name + ".weight", (fan_out, fan_in), not lora))
            if model.arch == "gpt":
                out.append((prefix + name + ".bias", (fan_out,), not lora))

        if model.arch == "gpt":
            out += [(prefix + "norm1.weight", (d,), not lora), (prefix + "norm1.bias", (d,), not lora)]
            linear("qkv")
            linear("proj")
            out += [(prefix + "norm2.weight", (d,), not lora), (prefix + "norm2.bias", (d,), not lora)]
            linear("mlp.0")
            linear("mlp.2")
        else:
            for name, _, _, _ in _linears(model):
                linear(name)
            out += [(prefix + "input_layernorm.weight", (d,), not lora),
                    (prefix + "post_attention_layernorm.weight", (d,), not lora)]
    if model.arch == "gpt":
        out += [("norm.weight", (d,), not lora), ("norm.bias", (d,), not lora),
                ("head.weight", (v, d), not lora), ("head.bias", (v,), not lora)]
    else:
        out.append(("norm.weight", (d,), not lora))
        if not model.tied_embeddings:
            out.append(("lm_head.weight", (v, d), not lora))
    return out


def count_parameters(model: ModelConfig, setup: TrainingSetup | None = None, *, trainable_only: bool = False) -> int:
    """Parameter elements of a ``ModelConfig`` (its LoRA adapters included when ``setup`` has a rank).

    Unlike ``utils.count_parameters``, which counts a built ``nn.Module``, this counts from the shape alone,
    so a 70B model needs no memory: ``count_parameters(PRESETS["70B"]) == 68_976_648_192``, the published count.

    Args:
        model: the shape.
        setup: for LoRA's adapters and frozen weights (default: full fine-tuning).
        trainable_only: count only what trains (the adapters, under LoRA).

    Returns:
        Elements (an int).
    """
    return sum(math.prod(shape) for _, shape, trainable in parameter_shapes(model, setup)
               if trainable or not trainable_only)


# --- the reference step, replayed --------------------------------------------------------------------------

class _Step(_Ops):
    """One step of ``reference_step`` for a model and set-up, replayed op by op."""

    def __init__(self, model: ModelConfig, setup: TrainingSetup, trace: bool = False) -> None:
        super().__init__(setup.device, trace)
        self.model, self.setup = model, setup
        item = 2 if setup.precision == "bf16" else 4
        self.leaves = {name: _Leaf(name, shape, item, trainable)
                       for name, shape, trainable in parameter_shapes(model, setup)}

    # -- pieces of the model
    def p(self, name: str) -> _T:
        return self.param(self.leaves[name])

    def lin(self, x: _T, prefix: str, name: str, attention: bool) -> _T:
        """A block's Linear, with its LoRA adapter when targeted: ``base(x) + B(A(x)) * alpha / r``."""
        fan_out = {n: o for n, _, o, _ in _linears(self.model)}[name]
        w = self.p(prefix + name + ".weight")
        b = self.p(prefix + name + ".bias") if self.model.arch == "gpt" else None
        base = self.linear(x, w, b, fan_out, prefix + name)
        if not _lora_on(self.setup, attention):
            return base
        h = self.linear(x, self.p(prefix + name + ".lora_a"), None, self.setup.lora_rank, prefix + name + ".lora_a")
        low = self.linear(h, self.p(prefix + name + ".lora_b"), None, fan_out, prefix + name + ".lora_b")
        self.rel(h)
        scaled = self.mul_scalar(low, prefix + name + " lora scale")
        self.rel(low)
        out = self.add(base, scaled, prefix + name + " lora sum")
        self.rel(base, scaled)
        return out

    def gpt_block(self, layer: int) -> Callable[[_Replay, _T], _T]:
        prefix = f"blocks.{layer}."
        setup, model = self.setup, self.model

        def block(r: _Replay, x: _T) -> _T:
            n1 = self.layer_norm(x, self.p(prefix + "norm1.weight"), self.p(prefix + "norm1.bias"), model.d_model,
                                 prefix + "norm1")
            qkv = self.lin(n1, prefix, "qkv", True)
            self.rel(n1)
            q, k, v = self.split3(qkv, prefix + "qkv")
            self.rel(qkv)
            attended = self.sdpa(q, k, v, setup.micro_batch * model.num_heads * setup.seq_len, prefix + "attention")
            x1_in = self.lin(attended, prefix, "proj", True)
            x1 = self.add(x, x1_in, prefix + "residual 1")
            self.rel(x1_in)
            n2 = self.layer_norm(x1, self.p(prefix + "norm2.weight"), self.p(prefix + "norm2.bias"), model.d_model,
                                 prefix + "norm2")
            hidden = self.lin(n2, prefix, "mlp.0", False)
            act = self.gelu(hidden, prefix + "gelu")
            self.rel(hidden)
            out = self.lin(act, prefix, "mlp.2", False)
            self.rel(act)
            self.rel(n2)
            x2 = self.add(x1, out, prefix + "residual 2")
            self.rel(out)
            self.rel(x1, q, k, v, attended)      # the block's locals, as Python frees them on return
            return x2

        return block

    def rms_norm(self, x: _T, w: _T, label: str) -> _T:
        """Hugging Face's ``LlamaRMSNorm``: in float32, ``weight * (x * rsqrt(mean(x^2) + eps)).to(dtype)``."""
        rows = x.numel // self.model.d_model
        h = self.to_float(x, f"{label} x.float()", "activations")
        squared = self.unary(h, "Pow", f"{label} x^2", save_input=True, temps=2)
        variance = self.unary(squared, "Mean", f"{label} mean", numel=rows)
        self.rel(squared)
        shifted = self.add_scalar(variance, f"{label} + eps")
        inv = self.unary(shifted, "Rsqrt", f"{label} rsqrt", save_output=True, temps=2)
        self.rel(shifted)
        normed = self.mul(h, inv, f"{label} x * rsqrt")
        self.rel(inv, h)
        low = self.to_float(normed, f"{label} .to(dtype)", "activations", x.item)
        out = self.mul(w, low, label)
        self.rel(low, normed, variance)
        return out

    def rope(self, t: _T, cos: _T, sin: _T, label: str) -> _T:
        """``(t * cos) + (rotate_half(t) * sin)``, rotate_half(t) = ``cat((-t[..., h:], t[..., :h]), -1)``."""
        first = self.mul(t, cos, f"{label} * cos", numel=t.numel)
        x1 = self.slice_half(t, f"{label}[:h]")
        x2 = self.slice_half(t, f"{label}[h:]")
        minus = self.neg(x2, f"-{label}[h:]")
        rotated = self.cat2(minus, x1, f"rotate_half({label})")
        self.rel(minus, x1, x2)
        second = self.mul(rotated, sin, f"{label} rotated * sin", numel=t.numel)
        self.rel(rotated)
        out = self.add(first, second, f"{label} rotary")
        self.rel(first, second)
        return out

    def llama_block(self, layer: int, cos: _T, sin: _T) -> Callable[[_Replay, _T], _T]:
        prefix = f"layers.{layer}."
        model, setup = self.model, self.setup
        groups = model.num_heads // model.kv_heads
        lse = setup.micro_batch * model.num_heads * setup.seq_len

        def block(r: _Replay, x: _T) -> _T:
            n1 = self.rms_norm(x, self.p(prefix + "input_layernorm.weight"), prefix + "input_layernorm")
            views = []
            # the gradient reaching .view().transpose() is non-contiguous, and reshaping it copies, unless it
            # comes straight from attention's backward (v without repeat) or has one key/value head
            for name, copy_grad in (("self_attn.q_proj", True), ("self_attn.k_proj", model.kv_heads > 1),
                                    ("self_attn.v_proj", groups > 1 and model.kv_heads > 1)):
                out = self.lin(n1, prefix, name, True)     # .view(B, T, heads, hd).transpose(1, 2)
                views.append(self.reshape_copy(out, prefix + name, copy_grad))
                self.rel(out)
            q, k, v = views
            q_rot = self.rope(q, cos, sin, prefix + "query")
            self.rel(q)
            k_rot = self.rope(k, cos, sin, prefix + "key")
            self.rel(k)
            k_rep = self.repeat_kv(k_rot, groups, prefix + "repeat_kv(key)")
            self.rel(k_rot)
            v_rep = self.repeat_kv(v, groups, prefix + "repeat_kv(value)")
            self.rel(v)
            attended = self.sdpa(q_rot, k_rep, v_rep, lse, prefix + "attention")
            attn = self.lin(attended, prefix, "self_attn.o_proj", True)
            self.rel(attended, q_rot, k_rep, v_rep)
            self.rel(n1)
            x1 = self.add(x, attn, prefix + "residual 1")
            self.rel(attn)
            n2 = self.rms_norm(x1, self.p(prefix + "post_attention_layernorm.weight"),
                               prefix + "post_attention_layernorm")
            gate = self.lin(n2, prefix, "mlp.gate_proj", False)
            act = self.unary(gate, "Silu", prefix + "silu", save_input=True)
            self.rel(gate)
            up = self.lin(n2, prefix, "mlp.up_proj", False)
            product = self.mul(act, up, prefix + "silu * up")
            self.rel(act, up)
            down = self.lin(product, prefix, "mlp.down_proj", False)
            self.rel(product)
            self.rel(n2)
            x2 = self.add(x1, down, prefix + "residual 2")
            self.rel(down, x1)
            return x2

        return block

    def rotary(self) -> tuple[_T, _T]:
        """cos and sin for every position, in float32 then in the activations' dtype (no gradient)."""
        model, seq = self.model, self.setup.seq_len
        half, hd = model.head_dim // 2, model.head_dim
        item = 2 if self.setup.precision == "bf16" else 4
        positions = self.new(seq, 8, "activations", "positions")
        inv = self.new(half, 4, "temporaries", "inv_freq.float()") if item == 2 else None
        pos = self.new(seq, 4, "temporaries", "position_ids.float()")
        freqs = self.new(half * seq, 4, "temporaries", "inv_freq @ positions")
        emb = self.new(seq * hd, 4, "temporaries", "cat(freqs, freqs)")
        raw = self.new(seq * hd, 4, "temporaries", "emb.cos()")
        cos = self.new(seq * hd, 4, "activations", "cos")
        self.rel(raw)
        raw = self.new(seq * hd, 4, "temporaries", "emb.sin()")
        sin = self.new(seq * hd, 4, "activations", "sin")
        self.rel(raw)
        cos_out, sin_out = (self.to_float(t, "cos/sin .to(dtype)", "activations", item) for t in (cos, sin))
        self.rel(inv, pos, freqs, emb, cos, sin, positions)
        return cos_out, sin_out

    def checkpointed(self, fn: Callable[[_Replay, _T], _T], x: _T, *extra: _T) -> _T:
        """``checkpoint(block, x, *extra, use_reentrant=False)`` (with notebook 03's policy when selective)."""
        region = _Region(fn, [x, *extra], self.setup.checkpointing == "selective")
        region.autocast = self.autocast
        for t in region.inputs:                   # the checkpoint keeps its inputs for the recompute
            self.incref(t.buf)
        outer, self.region = self.region, region
        out = fn(self, x)
        self.region = outer
        return out

    def embed(self) -> _T:
        model, setup = self.model, self.setup
        n_tok, d = setup.tokens, model.d_model
        if model.arch == "gpt":
            tok = self.embedding(self.p("token_embedding.weight"), n_tok * d, "token embedding")
            positions = self.new(setup.seq_len, 8, "activations", "positions")
            pos = self.embedding(self.p("position_embedding.weight"), setup.seq_len * d, "position embedding",
                                 positions)
            self.rel(positions)
            x = self.add(tok, pos, "embeddings", numel=n_tok * d)
            self.rel(tok, pos)
            return x
        return self.embedding(self.p("embed_tokens.weight"), n_tok * d, "token embedding")

    def head_loss(self, x: _T) -> _T:
        model, setup = self.model, self.setup
        d, v = model.d_model, model.vocab_size
        n_tok = setup.tokens
        if model.arch == "gpt":
            final = self.layer_norm(x, self.p("norm.weight"), self.p("norm.bias"), d, "norm")
            w, b = self.p("head.weight"), self.p("head.bias")
        else:
            final = self.rms_norm(x, self.p("norm.weight"), "norm")
            w = self.p("embed_tokens.weight" if model.tied_embeddings else "lm_head.weight")
            b = None
        if setup.chunked_loss:
            loss = self.chunked_loss(final, w, b)
            self.rel(final)
            return loss
        logits = self.linear(final, w, b, v, "logits")
        self.rel(final)
        for_loss = self.to_float(logits, "logits.float()")
        self.rel(logits)
        loss = self.cross_entropy(for_loss, n_tok)
        self.rel(for_loss)
        return loss

    def chunked_loss(self, hidden: _T, w: _T, b: _T | None) -> _T:
        """``utils.chunked_cross_entropy``: the head and the loss chunk by chunk, recomputed in backward."""
        n_tok, v, d = self.setup.tokens, self.model.vocab_size, self.model.d_model
        chunk = self.setup.chunked_loss
        grad_was = self.grad_enabled
        self.grad_enabled = False                 # inside autograd.Function.forward
        valid = self.new(n_tok, 1, "loss", "valid mask")
        zeros = self.new(n_tok, 8, "temporaries", "zeros_like(targets)")
        safe = self.new(n_tok, 8, "loss", "safe targets")
        self.rel(zeros)
        total = self.new(1, 4, "temporaries", "total")
        per_token = None
        for start in range(0, n_tok, chunk):
            c = min(chunk, n_tok - start)
            rows = self.view(hidden, c * d)
            logits = self.chunk_logits(rows, w, b, c)
            self.rel(rows)
            lse = self.new(c, 4, "temporaries", "logsumexp")
            picked = self.new(c, 4, "temporaries", "gather")
            new_per_token = self.new(c, 4, "temporaries", "per-token loss")
            self.rel(lse, picked, per_token)
            per_token = new_per_token
            self.rel(logits)
            masked = self.new(c, 4, "temporaries", "masked")
            chunk_sum = self.new(1, 4, "temporaries", "chunk sum")
            self.rel(masked, chunk_sum)
        count = self.new(1, 8, "loss", "count")
        self.grad_enabled = grad_was
        loss = self.new(1, 4, "loss", "loss")
        self.rel(total, per_token)
        edges = [(hidden, "alloc"), (w, "alloc")] + ([(b, "alloc")] if b is not None else [])
        n = self.node("ChunkedCrossEntropyBackward", edges, saved=[hidden, w] + ([b] if b is not None else [])
                      + [safe, valid, count])
        if n is not None:
            n.custom = self.chunked_loss_backward(hidden, w, b)
        self.rel(safe, valid, count)
        return self.output(loss, n)

    def chunk_logits(self, rows: _T, w: _T, b: _T | None, c: int) -> _T:
        """``F.linear(hidden_chunk, weight, bias).float()`` (autocast casts when it is on)."""
        v = self.model.vocab_size
        if self.autocast:
            casts = [self.cast16(b, "logits.bias bf16")] if b is not None else []
            casts += [self.cast16(w, "logits.weight bf16"), self.cast16(rows, "chunk bf16")]
            low = self.new(c * v, 2, "loss", "chunk logits")
            self.rel(*casts)
        else:
            low = self.new(c * v, w.item, "loss", "chunk logits")
        if low.item == 4:
            return low
        out = self.new(c * v, 4, "loss", "chunk logits.float()")
        self.rel(low)
        return out

    def chunked_loss_backward(self, hidden: _T, w: _T, b: _T | None) -> Callable[..., list]:
        n_tok, v, d = self.setup.tokens, self.model.vocab_size, self.model.d_model
        chunk = self.setup.chunked_loss

        def backward(r: _Replay, node: _Node, incoming: list) -> list:
            need_hidden, need_w = hidden.rg, w.rg
            need_b = b is not None and b.rg
            grad_hidden = r.new(hidden.numel, hidden.item, "temporaries", "grad hidden") if need_hidden else None
            grad_w = r.new(w.numel, 4, r._grad_kind(w) if w.item == 4 else "temporaries",
                           "grad head.weight") if need_w else None
            grad_b = r.new(b.numel, 4, r._grad_kind(b) if b.item == 4 else "temporaries",
                           "grad head.bias") if need_b else None
            scale = r.new(1, 4, "temporaries", "scale")
            rows_index = None
            for start in range(0, n_tok, chunk):
                c = min(chunk, n_tok - start)
                logits = r.new(c * v, w.item, "temporaries", "chunk logits (recomputed)")
                if w.item != 4:
                    full = r.new(c * v, 4, "temporaries", "chunk logits.float()")
                    r.rel(logits)
                    logits = full
                probs = r.new(c * v, 4, "temporaries", "softmax")
                r.rel(logits)
                new_rows = r.new(c, 8, "temporaries", "arange")
                r.rel(rows_index)
                rows_index = new_rows
                r.rel(r.new(c, 4, "temporaries", "index"))
                r.rel(r.new(c, 4, "temporaries", "valid * scale"))
                if grad_hidden is not None:
                    low = r.new(c * v, w.item, "temporaries", "probs.to(dtype)") if w.item != 4 else None
                    r.rel(r.new(c * d, w.item, "temporaries", "probs @ weight"), low)
                if grad_w is not None:
                    up = r.new(c * d, 4, "temporaries", "hidden.float()") if hidden.item != 4 else None
                    r.rel(up)
                if grad_b is not None:
                    r.rel(r.new(v, 4, "temporaries", "probs.sum(0)"))
                r.rel(probs)
            out = [grad_hidden]
            for grad, param in ((grad_w, w), (grad_b, b)):
                if param is None:
                    continue
                if grad is not None and param.item != 4:
                    cast = r.new(grad.numel, param.item, r._grad_kind(param), "grad.to(dtype)")
                    r.rel(grad)
                    grad = cast
                out.append(grad)
            r.rel(scale, rows_index)
            return out

        return backward

    # -- data parallelism: what each rank holds and gathers
    def unit_of(self, name: str) -> int:
        """The FSDP unit (block index, or -1 for the root: embeddings, final norm, head) a parameter is in."""
        head = name.split(".")
        return int(head[1]) if head[0] in ("blocks", "layers") else -1

    def gather(self, unit: int) -> None:
        """FSDP all-gathers a unit's parameters (every parameter, frozen ones too) before using them."""
        if self.setup.strategy != "fsdp" or unit in self.gathered or not -1 <= unit < self.model.num_layers:
            return
        size = sum(leaf.numel * leaf.item for leaf in self.leaves.values() if self.unit_of(leaf.name) == unit)
        self.gathered[unit] = self._alloc(size, "comm_buffers", f"all-gathered unit {unit}")
        self.incref(self.gathered[unit])

    def reshard(self, unit: int) -> None:
        buf = self.gathered.pop(unit, None)
        if buf is not None:
            self.decref(buf)

    def reduce_scatter(self, unit: int) -> None:
        """A unit's whole gradients become this rank's 1/N shard (added to the shard from earlier micro-batches)."""
        for leaf in self.leaves.values():
            if self.unit_of(leaf.name) != unit or leaf.name not in self.pending_grads:
                continue
            shard = _shard_numel(leaf.shape, self.setup.ranks) * leaf.item if self.setup.strategy == "fsdp" else \
                math.ceil(leaf.numel * leaf.item / self.setup.ranks)   # ZeRO-2: a flat 1/N partition
            for buf in self.pending_grads.pop(leaf.name):
                if leaf.grad is None:
                    leaf.grad = self._alloc(shard, "gradients", f"{leaf.name} grad shard")
                    self.incref(leaf.grad)
                else:
                    self.decref(self._incref_new(shard, f"{leaf.name} reduced shard"))
                self.decref(buf)

    def _incref_new(self, nbytes: int, label: str) -> _Buf:
        buf = self._alloc(nbytes, "temporaries", label)
        self.incref(buf)
        return buf

    def set_phase(self, phase: str) -> None:
        super().set_phase(phase)
        if self.setup.strategy not in ("zero2", "fsdp") or "." not in phase:
            return
        where = phase.split(".", 1)[1]
        last = self.model.num_layers - 1
        if where == "embed":
            self.gather(-1)
            self.gather(0)
        elif where[0] == "f":                    # forward of block i: i and the next are gathered, i - 1 resharded
            i = int(where[1:])
            self.gather(i)
            self.gather(i + 1)
            self.reshard(i - 1)
        elif where == "head":
            self.reshard(last)
        elif where == "bloss":
            self.gather(last)
        elif where[0] == "b":                    # backward of block i: block i + 1 is done
            i = int(where[1:])
            self.gather(i)
            self.gather(i - 1)
            self.reshard(i + 1)
            self.reduce_scatter(i + 1 if i < last else -1)

    def after_backward(self) -> None:
        if self.setup.strategy in ("zero2", "fsdp"):
            for unit in (0, -1):
                self.reshard(unit)
                self.reduce_scatter(unit)

    # -- the whole step
    def run(self) -> "_Step":
        model, setup = self.model, self.setup
        ranks = setup.ranks
        self.gathered: dict[int, _Buf] = {}
        self.pending_grads: dict[str, list[_Buf]] = {}
        self.param_shards = ranks if setup.strategy == "fsdp" else 1
        self.shard_grads = setup.strategy in ("zero2", "fsdp")
        for leaf in self.leaves.values():
            self.param(leaf)
        if model.arch == "llama":             # the rotary embedding's inv_freq buffer, in the model's dtype
            self.incref(self._alloc(model.head_dim // 2 * (2 if setup.precision == "bf16" else 4), "parameters",
                                    "rotary.inv_freq"))
        self.state_buf = self._alloc(_optimizer_state_per_rank(model, setup), "optimizer_state", "optimizer state")
        self.incref(self.state_buf)
        if setup.strategy in ("ddp", "zero1"):  # DDP's gradient buckets (gradient_as_bucket_view=False)
            buckets = sum(leaf.numel * leaf.item for leaf in self.leaves.values() if leaf.trainable)
            self.incref(self._alloc(buckets, "comm_buffers", "DDP gradient buckets"))
        batch = self._alloc(2 * 8 * setup.tokens * setup.accumulation_steps, "inputs", "token ids and targets")
        self.incref(batch)
        self.baseline = self.current
        # micro-batches after the second repeat it exactly (same state, same gradients alive): replay two
        for micro in range(min(setup.accumulation_steps, 2)):
            self.micro = micro
            self.set_phase(f"m{micro}.embed")
            if setup.precision == "bf16-autocast":
                self.autocast, self.cache = True, {}
            x = self.embed()
            rotary = self.rotary() if model.arch == "llama" else None
            for layer in range(model.num_layers):
                self.set_phase(f"m{micro}.f{layer}")
                fn = self.gpt_block(layer) if rotary is None else self.llama_block(layer, *rotary)
                out = self.checkpointed(fn, x, *(rotary or ())) if setup.checkpointing != "none" else fn(self, x)
                self.rel(x)
                x = out
                if x.node is not None:           # a hook on the block's output marks where its backward begins
                    x.node.phase = f"m{micro}.b{layer}"
            self.set_phase(f"m{micro}.head")
            if rotary is not None:
                self.rel(*rotary)
            loss = self.head_loss(x)
            self.rel(x)
            self.set_phase(f"m{micro}.exit")
            if self.autocast:
                self.autocast_exit()
            self.set_phase(f"m{micro}.bloss")
            scaled = self.div_scalar(loss, "loss / accumulation_steps")
            self.backward(scaled)
            self.after_backward()
            self.rel(scaled, loss)
        self.grads_mark = self.current            # what is alive when optimizer.step() begins
        self.grads_at_step = self.by_kind["gradients"]
        self.set_phase("optimizer")
        trainable = [leaf for leaf in self.leaves.values() if leaf.trainable]
        _optimizer_temporaries(self, _shard_leaves(trainable, setup), setup)
        for leaf in trainable:                   # zero_grad(set_to_none=True)
            if leaf.grad is not None:
                self.decref(leaf.grad)
                leaf.grad = None
        self.set_phase("end")
        return self


def _optimizer_state_bytes(model: ModelConfig, setup: TrainingSetup, ranks: int = 1) -> int:
    """Bytes of optimizer state on one device (of every tensor's FSDP shard when ``ranks`` > 1)."""
    from .footprint import predict_optimizer_state_bytes

    shapes = [shape for _, shape, trainable in parameter_shapes(model, setup) if trainable]
    if ranks > 1:
        shapes = [(math.ceil(shape[0] / ranks),) + tuple(shape[1:]) for shape in shapes]
    total = predict_optimizer_state_bytes(shapes, setup.optimizer)
    steps = 4 * len(shapes) if setup.optimizer in ("adam", "adamw", "adafactor") else 0
    elements = total - steps
    if setup.precision == "bf16" and setup.optimizer != "adamw8bit":
        elements //= 2                          # torch.optim keeps its state in the parameters' dtype
    if setup.device == "cuda" and setup.optimizer_impl != "fused":
        steps = 0                                # torch.optim keeps `step` on the host unless fused or capturable
    codebooks = 4 * sum(ADAMW8BIT_CODEBOOKS) if setup.optimizer == "adamw8bit" else 0   # kept on the optimizer
    return elements + steps + codebooks


def _shard_numel(shape: Sequence[int], ranks: int) -> int:
    """Elements of one rank's shard of a tensor under FSDP2: dim 0 split in N, padded (``ceil(dim0 / N)`` rows)."""
    if ranks == 1:
        return math.prod(shape)
    return math.ceil(shape[0] / ranks) * math.prod(shape[1:])


def _optimizer_state_per_rank(model: ModelConfig, setup: TrainingSetup) -> int:
    """Optimizer state on one rank: all of it (single, DDP), ZeRO's 1/N (ZeRO-1/2), or that of FSDP's shards.

    ZeRO-1/2 split the per-element state evenly (``ceil(K·Ψ / N)``) and the 4-byte step counters by whole
    tensors (``ceil(T / N)``), as ``utils.predict_zero_bytes_per_rank``; FSDP2 shards every tensor along
    dim 0 (padded), so each rank keeps the state of its shards and every step counter.
    """
    if setup.strategy in ("single", "ddp"):
        return _optimizer_state_bytes(model, setup)
    if setup.strategy == "fsdp":
        return _optimizer_state_bytes(model, setup, ranks=setup.ranks)
    total = _optimizer_state_bytes(model, setup)
    tensors = sum(1 for _, _, trainable in parameter_shapes(model, setup) if trainable)
    steps = 4 * tensors if (setup.optimizer in ("adam", "adamw", "adafactor")
                            and (setup.device == "cpu" or setup.optimizer_impl == "fused")) else 0
    codebooks = 4 * sum(ADAMW8BIT_CODEBOOKS) if setup.optimizer == "adamw8bit" else 0
    elements = total - steps - codebooks
    return math.ceil(elements / setup.ranks) + 4 * math.ceil(steps // 4 / setup.ranks) + codebooks


def _shard_leaves(leaves: list[_Leaf], setup: TrainingSetup) -> list[_Leaf]:
    """The tensors one rank's optimizer updates: all, or 1/N of each along dim 0 (ZeRO / FSDP)."""
    if setup.strategy in ("single", "ddp"):
        return leaves
    out = []
    for leaf in leaves:
        shape = (math.ceil(leaf.shape[0] / setup.ranks),) + tuple(leaf.shape[1:])
        out.append(_Leaf(leaf.name, shape, leaf.item, True))
    return out


def _optimizer_temporaries(r: _Replay, leaves: list[_Leaf], setup: TrainingSetup) -> None:
    """The allocations of one steady-state ``optimizer.step()`` (its state exists already)."""
    opt, impl = setup.optimizer, setup.optimizer_impl
    host_scalars = r.device == "cpu"            # torch.tensor(1.0) for CPU step counters
    if impl == "fused" or opt in ("sgd", "sgd_momentum"):
        return
    if opt in ("adam", "adamw"):
        if impl == "for-loop":                  # denom = (exp_avg_sq.sqrt() / bias_correction2_sqrt).add_(eps)
            previous = None
            for leaf in leaves:
                root = r.new(leaf.numel, leaf.item, "temporaries", f"sqrt {leaf.name}")
                denom = r.new(leaf.numel, leaf.item, "temporaries", f"denom {leaf.name}")
                r.rel(root, previous)
                previous = denom
            r.rel(previous)
        else:                                   # exp_avg_sq_sqrt = torch._foreach_sqrt(exp_avg_sqs)
            if host_scalars:
                r.rel(r.new(1, 4, "temporaries", "torch.tensor(1.0)"))
            roots = [r.new(leaf.numel, leaf.item, "temporaries", f"sqrt {leaf.name}") for leaf in leaves]
            r.rel(*reversed(roots))
        return
    if opt == "adafactor":
        if impl == "for-loop":
            _adafactor_for_loop(r, leaves)
        else:
            _adafactor_foreach(r, leaves, host_scalars)
        return
    _adamw8bit_temporaries(r, leaves)


ADAMW8BIT_BLOCK = 256                            # utils.AdamW8bit's default block_size
ADAMW8BIT_CODEBOOKS = (255, 256)                 # entries of utils.lowbit.signed_codebook / unsigned_codebook


def _adamw8bit_temporaries(r: _Replay, leaves: list[_Leaf], block: int = ADAMW8BIT_BLOCK) -> None:
    """utils.AdamW8bit's step, one tensor at a time: dequantise both moments, update, quantise them back."""
    for leaf in leaves:
        n = leaf.numel
        padded = math.ceil(n / block) * block
        blocks = padded // block
        grad = r.new(n, 4, "temporaries", "grad.float()") if leaf.item != 4 else None
        moments = []
        for _ in range(2):                       # codebook[codes.long()] * scales.repeat_interleave(block)[:n]
            index = r.new(n, 8, "temporaries", "codes.long()")
            values = r.new(n, 4, "temporaries", "codebook[codes]")
            r.rel(index)
            scales = r.new(padded, 4, "temporaries", "scales.repeat_interleave()")
            moments.append(r.new(n, 4, "temporaries", "dequantised moment"))
            r.rel(values, scales)
        weights = r.new(n, 4, "temporaries", "param.float()") if leaf.item != 4 else None
        denominator = r.new(n, 4, "temporaries", "denominator")
        for entries in ADAMW8BIT_CODEBOOKS:      # quantize_blockwise(exp_avg), then (exp_avg_sq)
            pad = r.new(padded, 4, "temporaries", "F.pad(flat)")
            absolute = r.new(padded, 4, "temporaries", "abs()")
            amax = r.new(blocks, 4, "temporaries", "amax()")
            r.rel(absolute)
            clamp = r.new(blocks, 4, "temporaries", "clamp()")
            normalized = r.new(padded, 4, "temporaries", "normalized")
            r.rel(clamp)
            total = r.new(entries - 1, 4, "temporaries", "codebook[1:] + codebook[:-1]")
            midpoints = r.new(entries - 1, 4, "temporaries", "midpoints")
            r.rel(total)
            bucket = r.new(padded, 8, "temporaries", "bucketize()")
            codes = r.new(padded, 1, "temporaries", "codes uint8")
            r.rel(bucket)
            r.rel(pad, amax, normalized, midpoints, codes)
        r.rel(grad, *moments, weights, denominator)


def _adafactor_for_loop(r: _Replay, leaves: list[_Leaf]) -> None:
    """torch.optim.Adafactor's for-loop: its locals (row_mean, col_mean, var_estimate, ...) live on to the next tensor."""
    row_mean = col_mean = update = grad_squared = None
    for leaf in leaves:
        item = leaf.item
        r.rel(r.new(1, item, "temporaries", "param.norm()"))
        dims = leaf.shape
        if len(dims) > 1:
            rows, cols = math.prod(dims[:-1]), math.prod(dims[:-2]) * dims[-1]
            new_row = r.new(rows, item, "temporaries", "row_mean")
            r.rel(row_mean)
            row_mean = new_row
            new_col = r.new(cols, item, "temporaries", "col_mean")
            r.rel(col_mean)
            col_mean = new_col
            estimate = r.new(leaf.numel, item, "temporaries", "row_var @ col_var")
            r.rel(r.new(math.prod(dims[:-2]), item, "temporaries", "row_var.mean()"))
        else:
            squared = r.new(leaf.numel, item, "temporaries", "grad * grad")
            r.rel(grad_squared)
            grad_squared = squared
            estimate = r.new(leaf.numel, item, "temporaries", "variance.clone()")
        r.rel(update)                            # `update = var_estimate.clamp_(...)` drops the previous one
        update = estimate
        r.rel(r.new(1, item, "temporaries", "update.norm()"))
    r.rel(row_mean, col_mean, update, grad_squared)


def _adafactor_foreach(r: _Replay, leaves: list[_Leaf], host_scalars: bool) -> None:
    """torch.optim.Adafactor's foreach: one pass per group (matrices, then vectors, in order of appearance)."""
    groups: dict[bool, list[_Leaf]] = {}
    for leaf in leaves:
        groups.setdefault(len(leaf.shape) > 1, []).append(leaf)
    updates: list[_T] = []
    for multidim, members in groups.items():
        if host_scalars:
            r.rel(r.new(1, 4, "temporaries", "torch.tensor(1.0)"))
        for leaf in members:
            r.rel(r.new(1, leaf.item, "temporaries", "p.norm()"))
        if multidim:
            for axis in (-1, -2):
                means = [r.new(math.prod(leaf.shape[:-1]) if axis == -1 else
                               math.prod(leaf.shape[:-2]) * leaf.shape[-1], leaf.item, "temporaries", "norm")
                         for leaf in members]
                r.rel(*reversed(means))
            estimates = [r.new(leaf.numel, leaf.item, "temporaries", "row_var @ col_var") for leaf in members]
            row_var_means = [r.new(math.prod(leaf.shape[:-2]), leaf.item, "temporaries", "row_var.mean()")
                             for leaf in members]
            r.rel(*reversed(row_var_means))
        else:
            squared = [r.new(leaf.numel, leaf.item, "temporaries", "grad * grad") for leaf in members]
            r.rel(*reversed(squared))
            estimates = [r.new(leaf.numel, leaf.item, "temporaries", "variance.clone()") for leaf in members]
        r.rel(*reversed(updates))                # `updates = var_estimates` drops the previous group's list
        updates = estimates
        for leaf in members:
            r.rel(r.new(1, leaf.item, "temporaries", "update.norm()"))
    r.rel(*reversed(updates))


# --- the measured side: the same step in plain PyTorch ---------------------------------------------------------

def _torch():  # noqa: ANN202 - imported lazily: predicting needs no torch
    import torch

    return torch


def _lora_linear_class():  # noqa: ANN202
    torch = _torch()
    from torch import nn
    import torch.nn.functional as F

    class LoRALinear(nn.Module):
        """A frozen Linear plus a trainable low-rank update: ``base(x) + B(A(x)) * alpha / r`` (LoRA, Hu et al. 2021).

        A starts random and B at zero, so training starts from the base model.
        """

        def __init__(self, base: nn.Linear, rank: int, alpha: float = 16.0) -> None:
            super().__init__()
            self.base = base.requires_grad_(False)
            self.lora_a = nn.Parameter(torch.randn(rank, base.in_features, dtype=base.weight.dtype) / base.in_features**0.5)
            self.lora_b = nn.Parameter(torch.zeros(base.out_features, rank, dtype=base.weight.dtype))
            self.scale = alpha / rank

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.base(x) + F.linear(F.linear(x, self.lora_a), self.lora_b) * self.scale

    return LoRALinear


def build_reference(model: ModelConfig, setup: TrainingSetup, *, seed: int = 0, device: str = "cpu"):  # noqa: ANN201
    """The model and optimizer ``reference_step`` trains: a ``utils.TinyTransformer`` (or ``LlamaLike``).

    LoRA wraps the targeted Linear layers in ``LoRALinear`` and freezes everything else; pure bf16
    converts the model with ``.to(torch.bfloat16)``.

    Returns:
        ``(model, optimizer)`` on ``device``.
    """
    torch = _torch()
    from .models import TinyTransformer

    torch.manual_seed(seed)
    if model.arch == "gpt":
        ratio, rest = divmod(model.ffn, model.d_model)   # TinyTransformer's MLP is mlp_ratio * d_model wide
        if rest:
            raise ValueError(f"arch 'gpt' builds utils.TinyTransformer, whose MLP is a multiple of d_model: expected "
                             f"ffn_width a multiple of {model.d_model}, got {model.ffn}")
        net = TinyTransformer(model.vocab_size, model.d_model, model.num_heads, model.num_layers,
                              max_seq_len=model.max_seq_len, mlp_ratio=ratio)
    else:
        net = llama_like(model)
    if setup.lora_rank:
        lora = _lora_linear_class()
        net.requires_grad_(False)
        blocks = net.blocks if model.arch == "gpt" else net.layers
        for block in blocks:
            for name, _, _, attention in _linears(model):
                if _lora_on(setup, attention):
                    parent, _, child = name.rpartition(".")
                    owner = block.get_submodule(parent) if parent else block
                    if child.isdigit():
                        owner[int(child)] = lora(owner[int(child)], setup.lora_rank)
                    else:
                        setattr(owner, child, lora(getattr(owner, child), setup.lora_rank))
    if setup.precision == "bf16":
        net = net.to(torch.bfloat16)
    net = net.to(device)
    params = [p for p in net.parameters() if p.requires_grad]
    impl = {"for-loop": {"foreach": False}, "foreach": {"foreach": True}, "fused": {"fused": True}}[setup.optimizer_impl]
    if setup.optimizer == "sgd":
        optimizer = torch.optim.SGD(params, lr=1e-3, **impl)
    elif setup.optimizer == "sgd_momentum":
        optimizer = torch.optim.SGD(params, lr=1e-3, momentum=0.9, **impl)
    elif setup.optimizer == "adam":
        optimizer = torch.optim.Adam(params, lr=1e-3, **impl)
    elif setup.optimizer == "adamw":
        optimizer = torch.optim.AdamW(params, lr=1e-3, **impl)
    elif setup.optimizer == "adafactor":
        optimizer = torch.optim.Adafactor(params, lr=1e-3, **impl)
    else:
        from .lowbit import AdamW8bit

        optimizer = AdamW8bit(params, lr=1e-3)
    return net, optimizer


_LLAMA_CLASSES: dict[str, Any] = {}


def _llama_classes() -> dict[str, Any]:
    """The Llama-style modules, written as Hugging Face's ``modeling_llama`` writes them (made once, lazily)."""
    if _LLAMA_CLASSES:
        return _LLAMA_CLASSES
    torch = _torch()
    import torch.nn.functional as F
    from torch import nn

    class RMSNorm(nn.Module):
        """``weight * x / sqrt(mean(x^2) + eps)``, computed in float32 as Hugging Face's ``LlamaRMSNorm``."""

        def __init__(self, width: int, eps: float = 1e-6) -> None:
            super().__init__()
            self.weight = nn.Parameter(torch.ones(width))
            self.variance_epsilon = eps

        def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
            input_dtype = hidden_states.dtype
            hidden_states = hidden_states.to(torch.float32)
            variance = hidden_states.pow(2).mean(-1, keepdim=True)
            hidden_states = hidden_states * torch.rsqrt(variance + self.variance_epsilon)
            return self.weight * hidden_states.to(input_dtype)

    class Rotary(nn.Module):
        """cos and sin of the rotary position embedding, once per forward (``LlamaRotaryEmbedding``)."""

        def __init__(self, head_dim: int, base: float = 10000.0) -> None:
            super().__init__()
            inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
            self.register_buffer("inv_freq", inv_freq, persistent=False)
            self.attention_scaling = 1.0

        def forward(self, x: torch.Tensor, position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            inv_freq_expanded = self.inv_freq[None, :, None].float().expand(position_ids.shape[0], -1, 1)
            position_ids_expanded = position_ids[:, None, :].float()
            with torch.autocast(device_type=x.device.type, enabled=False):          # force float32
                freqs = (inv_freq_expanded.float() @ position_ids_expanded.float()).transpose(1, 2)
                emb = torch.cat((freqs, freqs), dim=-1)
                cos = emb.cos() * self.attention_scaling
                sin = emb.sin() * self.attention_scaling
            return cos.to(dtype=x.dtype), sin.to(dtype=x.dtype)

    def rotate_half(x: torch.Tensor) -> torch.Tensor:
        x1 = x[..., : x.shape[-1] // 2]
        x2 = x[..., x.shape[-1] // 2:]
        return torch.cat((-x2, x1), dim=-1)

    def repeat_kv(hidden_states: torch.Tensor, n_rep: int) -> torch.Tensor:
        batch, num_key_value_heads, slen, head_dim = hidden_states.shape
        if n_rep == 1:
            return hidden_states
        hidden_states = hidden_states[:, :, None, :, :].expand(batch, num_key_value_heads, n_rep, slen, head_dim)
        return hidden_states.reshape(batch, num_key_value_heads * n_rep, slen, head_dim)

    class Attention(nn.Module):
        def __init__(self, config: ModelConfig) -> None:
            super().__init__()
            d, hd = config.d_model, config.head_dim
            self.head_dim, self.groups = hd, config.num_heads // config.kv_heads
            self.q_proj = nn.Linear(d, config.num_heads * hd, bias=False)
            self.k_proj = nn.Linear(d, config.kv_heads * hd, bias=False)
            self.v_proj = nn.Linear(d, config.kv_heads * hd, bias=False)
            self.o_proj = nn.Linear(config.num_heads * hd, d, bias=False)

        def forward(self, hidden_states: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
            input_shape = hidden_states.shape[:-1]
            hidden_shape = (*input_shape, -1, self.head_dim)
            query_states = self.q_proj(hidden_states).view(hidden_shape).transpose(1, 2)   # (B, H, T, hd)
            key_states = self.k_proj(hidden_states).view(hidden_shape).transpose(1, 2)     # (B, KV, T, hd)
            value_states = self.v_proj(hidden_states).view(hidden_shape).transpose(1, 2)
            cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
            query_states = (query_states * cos) + (rotate_half(query_states) * sin)
            key_states = (key_states * cos) + (rotate_half(key_states) * sin)
            key_states = repeat_kv(key_states, self.groups)                               # (B, H, T, hd)
            value_states = repeat_kv(value_states, self.groups)
            attn_output = F.scaled_dot_product_attention(query_states, key_states, value_states, is_causal=True)
            attn_output = attn_output.transpose(1, 2).contiguous()
            attn_output = attn_output.reshape(*input_shape, -1).contiguous()
            return self.o_proj(attn_output)

    class MLP(nn.Module):
        def __init__(self, config: ModelConfig) -> None:
            super().__init__()
            self.gate_proj = nn.Linear(config.d_model, config.ffn, bias=False)
            self.up_proj = nn.Linear(config.d_model, config.ffn, bias=False)
            self.down_proj = nn.Linear(config.ffn, config.d_model, bias=False)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))

    class DecoderLayer(nn.Module):
        def __init__(self, config: ModelConfig) -> None:
            super().__init__()
            self.self_attn = Attention(config)
            self.mlp = MLP(config)
            self.input_layernorm = RMSNorm(config.d_model)
            self.post_attention_layernorm = RMSNorm(config.d_model)

        def forward(self, hidden_states: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
            residual = hidden_states
            hidden_states = self.input_layernorm(hidden_states)
            hidden_states = self.self_attn(hidden_states, cos, sin)
            hidden_states = residual + hidden_states
            residual = hidden_states
            hidden_states = self.post_attention_layernorm(hidden_states)
            hidden_states = self.mlp(hidden_states)
            hidden_states = residual + hidden_states
            return hidden_states

    class LlamaLike(nn.Module):
        """A Llama-style decoder (``arch="llama"``), as Hugging Face writes it, for measuring on the CPU.

        Shapes: tokens (batch, seq) int64 -> logits (batch, seq, vocab_size). ``forward`` is the whole
        model; ``reference_step`` calls its parts (``embed_tokens``, ``rotary``, ``layers``, ``norm``,
        ``lm_head``) so that it can checkpoint the layers.
        """

        def __init__(self, config: ModelConfig) -> None:
            super().__init__()
            self.embed_tokens = nn.Embedding(config.vocab_size, config.d_model)
            self.layers = nn.ModuleList(DecoderLayer(config) for _ in range(config.num_layers))
            self.norm = RMSNorm(config.d_model)
            self.rotary = Rotary(config.head_dim)
            self.lm_head = nn.Linear(config.d_model, config.vocab_size, bias=False)
            if config.tied_embeddings:
                self.lm_head.weight = self.embed_tokens.weight

        def forward(self, tokens: torch.Tensor) -> torch.Tensor:
            x = self.embed_tokens(tokens)
            cos, sin = self.rotary(x, torch.arange(tokens.shape[1], device=tokens.device).unsqueeze(0))
            for layer in self.layers:
                x = layer(x, cos, sin)
            return self.lm_head(self.norm(x))

    _LLAMA_CLASSES.update(LlamaLike=LlamaLike, RMSNorm=RMSNorm)
    return _LLAMA_CLASSES


def llama_like(model: ModelConfig):  # noqa: ANN201 - an nn.Module made lazily
    """A ``LlamaLike`` module for ``model`` (``arch="llama"``): Hugging Face's Llama, written out in plain PyTorch.

    RMSNorm in float32, rotary embeddings (cos and sin computed once per forward), q/k/v/o projections
    without bias, the key/value heads repeated to the query heads (``repeat_kv``) before
    ``F.scaled_dot_product_attention(is_causal=True)``, a SwiGLU MLP, a head tied to the embedding or not.
    """
    if not isinstance(model, ModelConfig) or model.arch != "llama":
        raise ValueError("llama_like builds arch 'llama' models: expected a ModelConfig with arch='llama'")
    return _llama_classes()["LlamaLike"](model)


def _save_matmuls_policy():  # noqa: ANN202
    torch = _torch()
    from torch.utils.checkpoint import CheckpointPolicy

    matmuls = {torch.ops.aten.mm.default, torch.ops.aten.addmm.default, torch.ops.aten.bmm.default}

    def policy(ctx, op, *args, **kwargs):  # noqa: ANN001, ANN202
        return CheckpointPolicy.MUST_SAVE if op in matmuls else CheckpointPolicy.PREFER_RECOMPUTE

    return policy


def reference_step(net, optimizer, tokens, targets, model: ModelConfig, setup: TrainingSetup,  # noqa: ANN001
                   mem: Any = None) -> None:
    """One training step exactly as the calculator replays it: plain PyTorch, nothing hidden.

    For each of ``setup.accumulation_steps`` micro-batches: the forward under ``torch.autocast`` when
    the precision says so, each block checkpointed (non-reentrant) when asked, the loss
    (``F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())`` or
    ``utils.chunked_cross_entropy``), ``(loss / accumulation_steps).backward()``; then
    ``optimizer.step()`` and ``optimizer.zero_grad(set_to_none=True)``.

    Args:
        net, optimizer: from ``build_reference``.
        tokens, targets: (accumulation_steps, micro_batch, seq_len) int64, contiguous.
        model, setup: what ``net`` was built from.
        mem: a ``MemoryMeasurement`` (optional): its phase is set at every block boundary, forward and
            backward, so that a timeline compares with the replay's.
    """
    torch = _torch()
    import torch.nn.functional as F
    from functools import partial
    from torch.utils.checkpoint import checkpoint, create_selective_checkpoint_contexts

    from .activations import chunked_cross_entropy

    device_type = tokens.device.type
    autocast = setup.precision == "bf16-autocast"
    context_fn = partial(create_selective_checkpoint_contexts, _save_matmuls_policy())
    blocks = net.blocks if model.arch == "gpt" else net.layers
    for micro in range(setup.accumulation_steps):
        if mem is not None:
            mem.phase(f"m{micro}.embed")
        with torch.autocast(device_type, dtype=torch.bfloat16, enabled=autocast):
            if model.arch == "gpt":
                x = net.token_embedding(tokens[micro]) + net.position_embedding(
                    torch.arange(setup.seq_len, device=tokens.device))
                extra: tuple = ()
            else:
                x = net.embed_tokens(tokens[micro])
                extra = net.rotary(x, torch.arange(setup.seq_len, device=tokens.device).unsqueeze(0))  # cos, sin
            for index, block in enumerate(blocks):
                if mem is not None:
                    mem.phase(f"m{micro}.f{index}")
                if setup.checkpointing == "every_block":
                    x = checkpoint(block, x, *extra, use_reentrant=False)
                elif setup.checkpointing == "selective":
                    x = checkpoint(block, x, *extra, use_reentrant=False, context_fn=context_fn)
                else:
                    x = block(x, *extra)
                if mem is not None and x.requires_grad:
                    x.register_hook(lambda grad, name=f"m{micro}.b{index}": mem.phase(name))
            del extra
            if mem is not None:
                mem.phase(f"m{micro}.head")
            head = net.head if model.arch == "gpt" else net.lm_head
            if setup.chunked_loss:
                loss = chunked_cross_entropy(net.norm(x), head.weight, targets[micro], bias=head.bias,
                                             chunk_size=setup.chunked_loss)
            else:
                loss = F.cross_entropy(head(net.norm(x)).flatten(0, 1).float(), targets[micro].flatten())
            del x
            if mem is not None:
                mem.phase(f"m{micro}.exit")       # leaving autocast clears its cache of weight copies
        if mem is not None:
            mem.phase(f"m{micro}.bloss")
        (loss / setup.accumulation_steps).backward()
        del loss
    if mem is not None:
        mem.phase("optimizer")
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    if mem is not None:
        mem.phase("end")


# --- the public API ------------------------------------------------------------------------------------------

TERM_LABELS = {
    "parameters": "parameters",
    "gradients": "gradients",
    "optimizer_state": "optimizer state",
    "activations": "activations (saved for backward)",
    "loss": "loss and logits",
    "weight_copies": "autocast's bf16 weight copies",
    "comm_buffers": "data-parallel buffers",
    "inputs": "token ids and targets",
    "temporaries": "temporaries",
}


@dataclass(frozen=True)
class MemoryBreakdown:
    """The predicted peak of one training step on one device, and what is alive at that moment.

    The nine byte fields sum to ``total`` (the peak); ``largest`` gives each term at its own largest over
    the step (the terms peak at different moments, so ``sum(largest.values()) >= total``).

    Attributes:
        model, setup: what was predicted.
        parameters: the model's weights (this rank's shard under FSDP).
        gradients: ``param.grad`` (this rank's shards under ZeRO-2 and FSDP).
        optimizer_state: the optimizer's state (1/N under ZeRO-1/2 and FSDP).
        activations: tensors saved for backward (and recomputed ones, with checkpointing).
        loss: the logits, log-probabilities and loss tensors (the chunked loss's masks and chunks).
        weight_copies: autocast's bf16 copies of the weights.
        comm_buffers: DDP's gradient buckets; FSDP's all-gathered parameters; unsharded gradients before
            their reduce-scatter (modelled from the designs of DDP and FSDP2, not measured here).
        inputs: the step's token ids and targets (int64).
        temporaries: everything else: gradients flowing back, optimizer temporaries, recomputation.
        phase: where the peak happens ("forward, block 3", "backward, loss", "optimizer step", ...).
        largest: term -> its largest value during the step, bytes.
        num_parameters: parameter elements (adapters included); trainable_parameters: those that train.
    """

    model: ModelConfig
    setup: TrainingSetup
    parameters: int
    gradients: int
    optimizer_state: int
    activations: int
    loss: int
    weight_copies: int
    comm_buffers: int
    inputs: int
    temporaries: int
    phase: str
    largest: dict[str, int] = field(default_factory=dict)
    num_parameters: int = 0
    trainable_parameters: int = 0

    @property
    def total(self) -> int:
        """The peak, bytes: the sum of the terms alive at that moment."""
        return sum(getattr(self, kind) for kind in KINDS)

    def terms(self) -> dict[str, int]:
        """Term -> bytes alive at the peak, in ``KINDS`` order."""
        return {kind: getattr(self, kind) for kind in KINDS}


def _phase_label(phase: str, setup: TrainingSetup) -> str:
    if phase in ("optimizer", "end"):
        return "optimizer step"
    micro, _, where = phase.partition(".")
    names = {"embed": "forward, embeddings", "head": "forward, loss", "exit": "forward, leaving autocast",
             "bloss": "backward, loss"}
    if where in names:
        text = names[where]
    elif where[:1] == "f":
        text = f"forward, block {where[1:]}"
    elif where[:1] == "b":
        text = f"backward, block {where[1:]}"
    else:
        text = where
    if setup.accumulation_steps > 1:
        index = int(micro[1:])
        text += f" (micro-batch {index + 1}{'' if index == 0 else ' and later'})"
    return text


def _replay(model: ModelConfig, setup: TrainingSetup, trace: bool = False) -> _Step:
    if not isinstance(model, ModelConfig):
        raise TypeError(f"model must be a ModelConfig, got {type(model).__name__}")
    if not isinstance(setup, TrainingSetup):
        raise TypeError(f"setup must be a TrainingSetup, got {type(setup).__name__}")
    if model.arch == "gpt" and setup.seq_len > model.max_seq_len:
        raise ValueError(f"seq_len {setup.seq_len} exceeds the model's position table (max_seq_len "
                         f"{model.max_seq_len}): expected seq_len <= {model.max_seq_len}")
    if setup.strategy == "fsdp" and model.num_layers < 1:  # pragma: no cover - num_layers is positive
        raise ValueError("FSDP shards per block: expected at least one block")
    return _Step(model, setup, trace).run()


def predict(model: ModelConfig, setup: TrainingSetup) -> MemoryBreakdown:
    """Predict the peak memory of one training step on one device, term by term.

    Why: "will my model fit, and with what?" is answered by the peak, and the peak is a question of
    which tensors are alive together. This replays the step's allocations and frees (see the module's
    docstring) and reports the highest point and its make-up; on the CPU the exact tracker measures the
    same step to the byte (``validate``).

    Args:
        model: the transformer's shape (``ModelConfig`` or ``PRESETS[...]``).
        setup: how it trains (``TrainingSetup``).

    Returns:
        A ``MemoryBreakdown``; ``.total`` is the peak in bytes.

    Raises:
        TypeError: arguments of the wrong type.
        ValueError: a sequence longer than a ``"gpt"`` model's position table (the dataclasses check
            everything else when they are made).

    Example:
        >>> peak = predict(PRESETS["7B"], TrainingSetup(micro_batch=1, seq_len=4096))
        >>> peak.total / 2**30, peak.phase
    """
    step = _replay(model, setup)
    kinds = step.peak_kinds
    return MemoryBreakdown(model=model, setup=setup, phase=_phase_label(step.peak_phase, setup),
                           largest=dict(step.largest), num_parameters=count_parameters(model, setup),
                           trainable_parameters=count_parameters(model, setup, trainable_only=True),
                           **{kind: kinds.get(kind, 0) for kind in KINDS})


def largest_micro_batch(model: ModelConfig, setup: TrainingSetup, device_bytes: int, *, limit: int = 4096) -> int:
    """The largest micro-batch whose predicted peak fits in ``device_bytes`` (0 if not even one fits).

    The peak never shrinks as the micro-batch grows, so this doubles, then bisects, like
    ``utils.find_max_batch_size`` does with real steps.

    Args:
        model, setup: as for ``predict`` (``setup.micro_batch`` is ignored).
        device_bytes: memory available to tensors on one device, bytes (what the allocator may use:
            leave room for the CUDA context and fragmentation, e.g. 90 % of the card).
        limit: the largest micro-batch tried.

    Returns:
        The micro-batch (an int in [0, limit]).

    Example:
        >>> largest_micro_batch(PRESETS["1B"], TrainingSetup(seq_len=2048, checkpointing="every_block"),
        ...                     int(0.9 * 80 * 10**9))
    """
    positive_int("device_bytes", device_bytes, "bytes")
    positive_int("limit", limit)

    def fits(batch: int) -> bool:
        return predict(model, replace(setup, micro_batch=batch)).total <= device_bytes

    if not fits(1):
        return 0
    good, bad = 1, None
    while bad is None and good < limit:
        trial = min(2 * good, limit)
        if fits(trial):
            good = trial
        else:
            bad = trial
    while bad is not None and bad - good > 1:
        middle = (good + bad) // 2
        if fits(middle):
            good = middle
        else:
            bad = middle
    return good


def _gib(num_bytes: float) -> str:
    return f"{num_bytes / 2**30:,.2f}"


def format_table(breakdown: MemoryBreakdown, *, device_bytes: int | None = None) -> str:
    """The breakdown as a plain-text table: each term at the peak and at its own largest, in GiB.

    Args:
        breakdown: what ``predict`` returned.
        device_bytes: optionally, a device's memory: the last line says whether the peak fits.

    Returns:
        The table, one line per term, without a trailing newline.
    """
    if not isinstance(breakdown, MemoryBreakdown):
        raise TypeError(f"expected a MemoryBreakdown, got {type(breakdown).__name__}")
    model, setup = breakdown.model, breakdown.setup
    lora = f"LoRA r={setup.lora_rank} ({setup.lora_targets})" if setup.lora_rank else "full fine-tuning"
    lines = [
        f"{model.name}: {breakdown.num_parameters / 1e9:,.3f} B parameters ({breakdown.trainable_parameters / 1e9:,.3f} B "
        f"trainable), {model.num_layers} layers, d_model {model.d_model}, {model.num_heads} heads "
        f"({model.kv_heads} kv), ffn {model.ffn}, vocab {model.vocab_size}",
        f"micro-batch {setup.micro_batch} x {setup.seq_len} tokens, {setup.precision}, {setup.optimizer} "
        f"({setup.optimizer_impl}), checkpointing {setup.checkpointing}, {lora}, "
        f"loss {'chunked by ' + str(setup.chunked_loss) if setup.chunked_loss else 'whole'}, "
        f"accumulation {setup.accumulation_steps}, {setup.strategy} on {setup.ranks} rank(s), {setup.device}",
        "",
        f"{'term (GiB per device)':<36}{'at the peak':>14}{'own largest':>14}",
    ]
    for kind in KINDS:
        at_peak, largest = getattr(breakdown, kind), breakdown.largest.get(kind, 0)
        if at_peak == 0 and largest == 0:
            continue
        lines.append(f"{TERM_LABELS[kind]:<36}{_gib(at_peak):>14}{_gib(largest):>14}")
    lines.append(f"{'peak (' + breakdown.phase + ')':<36}{_gib(breakdown.total):>14}")
    if device_bytes is not None:
        positive_int("device_bytes", device_bytes, "bytes")
        verdict = "fits" if breakdown.total <= device_bytes else "does not fit"
        lines.append(f"{verdict} in {_gib(device_bytes)} GiB ({breakdown.total / device_bytes:.0%} of it)")
    return "\n".join(lines)


# --- presets: the published shapes of public models -----------------------------------------------------------

PRESETS: dict[str, ModelConfig] = {
    # Llama 3.2 1B (Meta, 2024; config.json of meta-llama/Llama-3.2-1B): grouped-query attention, tied head
    "1B": ModelConfig(num_layers=16, d_model=2048, num_heads=32, num_kv_heads=8, ffn_width=8192, vocab_size=128256,
                      max_seq_len=131072, arch="llama", tied_embeddings=True, name="Llama-3.2-1B"),
    # Llama 2 7B, 13B and 70B (Touvron et al. 2023, "Llama 2", table 1; config.json of meta-llama/Llama-2-*-hf)
    "7B": ModelConfig(num_layers=32, d_model=4096, num_heads=32, ffn_width=11008, vocab_size=32000, max_seq_len=4096,
                      arch="llama", name="Llama-2-7B"),
    "13B": ModelConfig(num_layers=40, d_model=5120, num_heads=40, ffn_width=13824, vocab_size=32000, max_seq_len=4096,
                       arch="llama", name="Llama-2-13B"),
    "70B": ModelConfig(num_layers=80, d_model=8192, num_heads=64, num_kv_heads=8, ffn_width=28672, vocab_size=32000,
                       max_seq_len=4096, arch="llama", name="Llama-2-70B"),
}


def preset(name: str) -> ModelConfig:
    """The ``ModelConfig`` of a preset (``"1B"``, ``"7B"``, ``"13B"``, ``"70B"``).

    Raises:
        ValueError: an unknown name (the message lists the presets and the models they are).
    """
    if name not in PRESETS:
        known = ", ".join(f"{key} ({cfg.name})" for key, cfg in PRESETS.items())
        raise ValueError(f"unknown preset {name!r}: expected one of {known}")
    return PRESETS[name]


# --- measuring the same step, and the validation grid ----------------------------------------------------------

MEASURED_TERMS = ("parameters", "optimizer_state", "inputs", "activations", "loss", "gradients", "peak")


@dataclass(frozen=True)
class StepBytes:
    """The figures of one training step that prediction and measurement both give, bytes.

    Attributes:
        parameters: the model's parameters and buffers.
        optimizer_state: the optimizer's state (and AdamW8bit's codebooks).
        inputs: token ids and targets of the step.
        activations: bytes alive above those three when the head begins (saved activations, plus
            autocast's bf16 weight copies).
        loss: what the head and the loss add by the end of the forward pass.
        gradients: bytes alive when ``optimizer.step()`` begins, above the baseline (the gradients).
        peak: the highest point of the step, the baseline included.
        boundaries: phase -> bytes alive above the baseline when it ended (a phase is a block's forward
            or backward, the head, the loss's backward, the optimizer step).
    """

    parameters: int
    optimizer_state: int
    inputs: int
    activations: int
    loss: int
    gradients: int
    peak: int
    boundaries: dict[str, int] = field(default_factory=dict)


def model_state_per_rank(model: ModelConfig, setup: TrainingSetup) -> dict[str, int]:
    """Parameters, gradients (when the optimizer step begins) and optimizer state held by one rank, bytes.

    ZeRO's accounting, as ``utils.parallel.predict_zero_bytes_per_rank`` gives it for ``ddp`` (stage 0),
    ``zero1``, ``zero2`` and ``fsdp`` (stage 3); FSDP2 pads every tensor's dim 0 to a multiple of N,
    so with dims that N does not divide its shards are up to one row per tensor larger than Ψ/N.

    Returns:
        ``{"params": ..., "grads": ..., "optimizer": ...}``; also ``"buckets"``: DDP's (and ZeRO-1's)
        gradient buckets, one copy of the trainable gradients (``gradient_as_bucket_view=False``).
    """
    step = _replay(model, setup)
    buckets = sum(math.prod(shape) for _, shape, trainable in parameter_shapes(model, setup) if trainable) * (
        2 if setup.precision == "bf16" else 4) if setup.strategy in ("ddp", "zero1") else 0
    return {"params": step.largest["parameters"], "grads": step.grads_at_step,
            "optimizer": step.largest["optimizer_state"], "buckets": buckets}


def predict_step_bytes(model: ModelConfig, setup: TrainingSetup) -> StepBytes:
    """The prediction of the figures ``measure_reference_step`` measures (see ``StepBytes``)."""
    step = _replay(model, setup)
    base = step.baseline
    last = f"m0.f{model.num_layers - 1}"
    marks = {phase: value - base for phase, value in step.phase_marks.items() if phase not in ("start", "end")}
    return StepBytes(parameters=step.largest["parameters"], optimizer_state=step.largest["optimizer_state"],
                     inputs=step.largest["inputs"], activations=marks[last], loss=marks["m0.head"] - marks[last],
                     gradients=step.grads_mark - base, peak=step.peak, boundaries=marks)


def measure_reference_step(model: ModelConfig, setup: TrainingSetup, *, device: Any = "cpu",
                           seed: int = 0) -> StepBytes:
    """Measure ``reference_step`` on a device: the same figures as ``predict_step_bytes``.

    One warm-up step creates the optimizer state; the second step is measured with
    ``utils.measure_memory``, its baseline being the model, the optimizer and the batch. On the CPU
    that is the exact storage tracker; on CUDA the caching allocator (**this branch has not been run on
    a GPU yet**: ``torch.cuda.reset_peak_memory_stats`` and ``max_memory_allocated`` around the step,
    through ``measure_memory``'s "cuda-allocator" backend; expect differences of cuBLAS workspaces and
    512-byte rounding per tensor, and of the attention kernel's saved statistics).

    Args:
        model, setup: what to build and train (``setup.device`` is set to the device's type).
        device: where to run it.
        seed: for the weights and the data.

    Returns:
        A ``StepBytes``.
    """
    torch = _torch()
    from .memory import measure_memory, tensor_bytes
    from .models import make_token_data

    device = torch.device(device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("measuring on 'cuda' needs a CUDA GPU, and torch.cuda.is_available() is False here: "
                           "expected device='cpu' (the exact tracker)")
    if device.type not in ("cpu", "cuda"):
        raise ValueError(f"expected device 'cpu' or 'cuda', got {str(device)!r}")
    setup = replace(setup, device="cuda" if device.type == "cuda" else "cpu")
    if model.arch == "gpt" and setup.seq_len > model.max_seq_len:
        raise ValueError(f"seq_len {setup.seq_len} exceeds max_seq_len {model.max_seq_len}")
    net, optimizer = build_reference(model, setup, seed=seed, device=device)
    k, batch, seq = setup.accumulation_steps, setup.micro_batch, setup.seq_len
    tokens, targets = make_token_data(batch * k, seq, model.vocab_size, seed=seed, device=device)
    tokens, targets = tokens.reshape(k, batch, seq).contiguous(), targets.reshape(k, batch, seq).contiguous()
    reference_step(net, optimizer, tokens, targets, model, setup)          # creates the optimizer state
    codebooks = list(getattr(optimizer, "_codebooks", {}).values())        # AdamW8bit keeps them on itself
    with measure_memory(device, include=[net, optimizer, tokens, targets, codebooks], phase="start") as mem:
        reference_step(net, optimizer, tokens, targets, model, setup, mem)
    ends = mem.phase_end_bytes()
    last = f"m0.f{model.num_layers - 1}"
    optimizer_index = next(i for i, sample in enumerate(mem.timeline) if sample.phase == "optimizer")
    before_step = mem.timeline[optimizer_index - 1].bytes
    boundaries = {phase: value for phase, value in ends.items() if phase not in ("start", "end")}
    # torch.optim keeps `step` on the host unless fused: count what lives on the measured device
    state = [t for t in _state_tensors(optimizer) if t.device.type == device.type] + codebooks
    return StepBytes(parameters=tensor_bytes(list(net.parameters()) + list(net.buffers())),
                     optimizer_state=tensor_bytes(state), inputs=tensor_bytes([tokens, targets]),
                     activations=ends[last], loss=ends["m0.head"] - ends[last], gradients=before_step,
                     peak=mem.peak_bytes + mem.baseline_bytes, boundaries=boundaries)


def _state_tensors(optimizer: Any) -> list:
    torch = _torch()
    return [value for state in optimizer.state.values() for value in state.values() if isinstance(value, torch.Tensor)]


GRID_GPT = ModelConfig(num_layers=2, d_model=32, num_heads=4, vocab_size=64, max_seq_len=16, name="tiny gpt")
GRID_LLAMA = ModelConfig(num_layers=2, d_model=32, num_heads=4, num_kv_heads=2, ffn_width=48, vocab_size=64,
                         max_seq_len=16, arch="llama", name="tiny llama")


def validation_grid(check: bool = False) -> list[tuple[str, ModelConfig, TrainingSetup]]:
    """The configurations ``validate`` measures: every option of ``TrainingSetup`` at least once.

    Two small models (``GRID_GPT``, a ``utils.TinyTransformer``; ``GRID_LLAMA``, grouped-query
    attention) with micro-batch 2 x 16 tokens on the CPU. ``check=True`` gives the representative subset
    the tests run in check mode (each precision, optimizer, implementation, checkpointing mode, LoRA
    target, the chunked loss, accumulation and both architectures at least once).

    Returns:
        (label, model, setup) triples.
    """
    base = TrainingSetup(micro_batch=2, seq_len=16, precision="fp32", optimizer="adamw", optimizer_impl="for-loop",
                         device="cpu")
    gpt, llama = GRID_GPT, GRID_LLAMA
    mqa_tied = replace(GRID_LLAMA, num_kv_heads=1, tied_embeddings=True, name="tiny llama, 1 kv head, tied head")
    mha = replace(GRID_LLAMA, num_kv_heads=None, name="tiny llama, 4 kv heads")

    def s(**changes: Any) -> TrainingSetup:
        return replace(base, **changes)

    ac, bf = "bf16-autocast", "bf16"
    grid = [
        ("gpt fp32 adamw", gpt, s()),
        ("gpt autocast", gpt, s(precision=ac)),
        ("gpt bf16", gpt, s(precision=bf)),
        ("gpt fp32 ckpt every block", gpt, s(checkpointing="every_block")),
        ("gpt fp32 ckpt selective", gpt, s(checkpointing="selective")),
        ("gpt autocast ckpt every block", gpt, s(precision=ac, checkpointing="every_block")),
        ("gpt autocast ckpt selective", gpt, s(precision=ac, checkpointing="selective")),
        ("gpt bf16 ckpt selective", gpt, s(precision=bf, checkpointing="selective")),
        ("gpt fp32 lora r4 all", gpt, s(lora_rank=4)),
        ("gpt autocast lora r4 attention", gpt, s(precision=ac, lora_rank=4, lora_targets="attention")),
        ("gpt autocast lora ckpt every block", gpt, s(precision=ac, lora_rank=4, checkpointing="every_block")),
        ("gpt bf16 lora attention ckpt selective", gpt, s(precision=bf, lora_rank=4, lora_targets="attention",
                                                           checkpointing="selective")),
        ("gpt fp32 chunked loss 12", gpt, s(chunked_loss=12)),
        ("gpt autocast chunked loss 12", gpt, s(precision=ac, chunked_loss=12)),
        ("gpt fp32 accumulation 3", gpt, s(accumulation_steps=3)),
        ("gpt autocast accum 2 ckpt every block", gpt, s(precision=ac, accumulation_steps=2,
                                                          checkpointing="every_block")),
        ("gpt fp32 sgd", gpt, s(optimizer="sgd")),
        ("gpt fp32 sgd momentum foreach", gpt, s(optimizer="sgd_momentum", optimizer_impl="foreach")),
        ("gpt fp32 adam fused", gpt, s(optimizer="adam", optimizer_impl="fused")),
        ("gpt fp32 adamw foreach", gpt, s(optimizer_impl="foreach")),
        ("gpt bf16 adamw fused", gpt, s(precision=bf, optimizer_impl="fused")),
        ("gpt fp32 adafactor", gpt, s(optimizer="adafactor")),
        ("gpt bf16 adafactor foreach", gpt, s(precision=bf, optimizer="adafactor", optimizer_impl="foreach")),
        ("gpt fp32 adamw8bit", gpt, s(optimizer="adamw8bit")),
        ("gpt bf16 adamw8bit lora", gpt, s(precision=bf, optimizer="adamw8bit", lora_rank=4)),
        ("llama fp32 gqa", llama, s()),
        ("llama autocast", llama, s(precision=ac)),
        ("llama bf16", llama, s(precision=bf)),
        ("llama autocast ckpt every block", llama, s(precision=ac, checkpointing="every_block")),
        ("llama fp32 ckpt selective", llama, s(checkpointing="selective")),
        ("llama autocast lora r4 all", llama, s(precision=ac, lora_rank=4)),
        ("llama bf16 lora attention ckpt every", llama, s(precision=bf, lora_rank=4, lora_targets="attention",
                                                          checkpointing="every_block")),
        ("llama mqa tied autocast chunked 12", mqa_tied, s(precision=ac, chunked_loss=12)),
        ("llama mqa tied bf16 accumulation 2", mqa_tied, s(precision=bf, accumulation_steps=2)),
        ("llama mha fp32 sgd momentum", mha, s(optimizer="sgd_momentum")),
        ("llama autocast adamw8bit", llama, s(precision=ac, optimizer="adamw8bit")),
        ("llama bf16 adafactor foreach ckpt sel", llama, s(precision=bf, optimizer="adafactor",
                                                           optimizer_impl="foreach", checkpointing="selective")),
        ("llama autocast adamw foreach lora sel", llama, s(precision=ac, optimizer_impl="foreach", lora_rank=4,
                                                           checkpointing="selective")),
    ]
    if not check:
        return grid
    subset = ("gpt autocast lora ckpt every block", "gpt bf16 lora attention ckpt selective", "gpt autocast chunked loss 12",
              "gpt fp32 sgd momentum foreach", "gpt fp32 adam fused", "gpt bf16 adafactor foreach",
              "llama mqa tied bf16 accumulation 2", "llama autocast adamw8bit", "llama autocast lora r4 all",
              "gpt fp32 adafactor", "gpt fp32 sgd")
    return [row for row in grid if row[0] in subset]


@dataclass(frozen=True)
class ValidationRow:
    """One configuration of the grid: predicted and measured ``StepBytes``.

    Attributes:
        label: the configuration's name in the grid.
        model, setup: what was predicted and measured.
        predicted: ``predict_step_bytes(model, setup)``.
        measured: ``measure_reference_step(model, setup)``.
    """

    label: str
    model: ModelConfig
    setup: TrainingSetup
    predicted: StepBytes
    measured: StepBytes

    def errors(self) -> dict[str, float]:
        """Term -> |predicted - measured| / |measured| (0 when both are 0)."""
        out = {}
        for term in MEASURED_TERMS:
            p, m = getattr(self.predicted, term), getattr(self.measured, term)
            out[term] = abs(p - m) / abs(m) if m else float(p != m)
        return out

    def differences(self) -> dict[str, int]:
        """Term -> predicted - measured, bytes."""
        return {term: getattr(self.predicted, term) - getattr(self.measured, term) for term in MEASURED_TERMS}

    @property
    def boundaries_equal(self) -> bool:
        """Whether the bytes alive at every phase boundary of the step agree too (not only the terms)."""
        return all(self.predicted.boundaries.get(k) == v for k, v in self.measured.boundaries.items()
                   if k in self.predicted.boundaries)


def validate(grid: Sequence[tuple[str, ModelConfig, TrainingSetup]] | None = None, *, check: bool = False,
             device: Any = "cpu", progress: Callable[[ValidationRow], None] | None = None) -> list[ValidationRow]:
    """Measure every configuration of the grid and put the prediction beside it.

    Args:
        grid: (label, model, setup) triples; default ``validation_grid(check)``.
        check: the representative subset (a few seconds on the CPU) instead of the whole grid.
        device: where to measure: "cpu" (the exact tracker) or "cuda" (the allocator; not yet run).
        progress: called with each row as soon as it is measured.

    Returns:
        One ``ValidationRow`` per configuration. On the CPU every difference is 0 bytes.
    """
    rows = []
    for label, model, setup in grid if grid is not None else validation_grid(check):
        kind = "cuda" if str(device).startswith("cuda") else "cpu"
        setup = replace(setup, device=kind)
        row = ValidationRow(label, model, setup, predict_step_bytes(model, setup),
                            measure_reference_step(model, setup, device=device))
        rows.append(row)
        if progress is not None:
            progress(row)
    return rows


def worst_errors(rows: Sequence[ValidationRow]) -> dict[str, float]:
    """Term (``MEASURED_TERMS``) -> the largest relative error |predicted - measured| / measured over the rows."""
    return {term: max((row.errors()[term] for row in rows), default=0.0) for term in MEASURED_TERMS}


VALIDATION_HEADER = f"{'configuration (peak, bytes)':<42}{'predicted':>13}{'measured':>13}{'diff':>6}  {'peak in':<44}terms"


def format_validation_row(row: ValidationRow) -> str:
    """One line: predicted and measured peak (bytes), where the peak is, and whether every term agrees."""
    diff = row.differences()
    worst = max(diff, key=lambda term: abs(diff[term]))
    where = _phase_label(_replay(row.model, row.setup).peak_phase, row.setup)
    text = (f"{row.label:<42}{row.predicted.peak:>13,}{row.measured.peak:>13,}{diff['peak']:>+6,}  {where:<44}"
            f"{'all equal' if not any(diff.values()) else f'largest difference: {worst} {diff[worst]:+,} B'}")
    return text + ("" if row.boundaries_equal else "  (phase boundaries differ)")


def format_validation(rows: Sequence[ValidationRow]) -> str:
    """The grid as a table (predicted and measured peak per configuration) and the worst error per term."""
    lines = [VALIDATION_HEADER]
    lines += [format_validation_row(row) for row in rows]
    worst = worst_errors(rows)
    lines.append("worst relative error per term: " + ", ".join(f"{term} {value:.2e}" for term, value in worst.items()))
    return "\n".join(lines)


# --- the command line ------------------------------------------------------------------------------------------

def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m utils.calculator",
        description="Predict the peak training memory per device, term by term (parameters, gradients, "
                    "optimizer state, activations, loss, temporaries), for a preset or your own transformer. "
                    "--validate measures a grid of small models on the CPU against the prediction.")
    shape = parser.add_argument_group("model (a preset, or your own shape)")
    shape.add_argument("--preset", choices=sorted(PRESETS, key=lambda k: float(k[:-1])),
                       help="; ".join(f"{key}: {cfg.name}" for key, cfg in PRESETS.items()))
    shape.add_argument("--arch", choices=ARCHS, default=None, help="block design (default llama for a custom shape)")
    for flag, help_text in [("--layers", "transformer blocks"), ("--d-model", "residual width"),
                            ("--heads", "attention heads"), ("--kv-heads", "key/value heads (default: --heads)"),
                            ("--ffn", "MLP hidden width (default 4 x d-model)"), ("--vocab", "vocabulary size"),
                            ("--max-seq-len", "position table rows (gpt) / context length")]:
        shape.add_argument(flag, type=int, default=None, help=help_text)
    shape.add_argument("--tied", action="store_true", help="the head shares the embedding's weight (llama)")
    train = parser.add_argument_group("training set-up")
    train.add_argument("--micro-batch", type=int, default=1, help="sequences per device (default 1)")
    train.add_argument("--seq-len", type=int, default=4096, help="tokens per sequence (default 4096)")
    train.add_argument("--precision", choices=PRECISIONS, default="bf16-autocast")
    train.add_argument("--optimizer", choices=OPTIMIZERS, default="adamw")
    train.add_argument("--impl", choices=OPTIMIZER_IMPLS, default="foreach",
                       help="torch.optim implementation (default foreach, CUDA's default)")
    train.add_argument("--checkpointing", choices=CHECKPOINTING, default="none")
    train.add_argument("--lora-rank", type=int, default=0, help="0: full fine-tuning")
    train.add_argument("--lora-targets", choices=LORA_TARGETS, default="all")
    train.add_argument("--chunked-loss", type=int, default=0, help="tokens per chunk (0: the whole logits)")
    train.add_argument("--accumulation", type=int, default=1, help="micro-batches per optimizer step")
    train.add_argument("--strategy", choices=STRATEGIES, default="single")
    train.add_argument("--ranks", type=int, default=1)
    train.add_argument("--device", choices=DEVICES, default="cuda", help="whose op-level details (default cuda)")
    train.add_argument("--device-gb", type=float, default=80.0,
                       help="device memory in GB (10^9 bytes) for the fit verdict and the largest micro-batch "
                            "(default 80; 0 skips both)")
    parser.add_argument("--validate", action="store_true", help="measure the grid on the CPU against the prediction")
    parser.add_argument("--check", action="store_true", help="with --validate: the quick representative subset")
    parser.add_argument("--on", default="cpu", choices=("cpu", "cuda"),
                        help="with --validate: the device to measure on (cuda: the allocator's figures; this branch "
                             "has not been run on a GPU yet)")
    return parser


def _model_from_args(args: argparse.Namespace, parser: argparse.ArgumentParser) -> ModelConfig:
    custom = {"num_layers": args.layers, "d_model": args.d_model, "num_heads": args.heads, "vocab_size": args.vocab,
              "ffn_width": args.ffn, "num_kv_heads": args.kv_heads, "max_seq_len": args.max_seq_len}
    if args.preset:
        given = [flag for flag, value in custom.items() if value is not None]
        if given or args.arch or args.tied:
            parser.error(f"--preset {args.preset} fixes the shape: expected no shape flags with it, got {given}")
        return PRESETS[args.preset]
    missing = [flag for flag in ("--layers", "--d-model", "--heads", "--vocab")
               if getattr(args, flag[2:].replace("-", "_")) is None]
    if missing:
        parser.error(f"expected --preset or a shape: missing {', '.join(missing)}")
    custom = {key: value for key, value in custom.items() if value is not None}
    custom.setdefault("max_seq_len", max(args.seq_len, 2048))
    return ModelConfig(arch=args.arch or "llama", tied_embeddings=args.tied, **custom)


def main(argv: Sequence[str] | None = None) -> int:
    """The command line; returns the exit status."""
    parser = _parser()
    args = parser.parse_args(argv)
    if args.validate:
        print(VALIDATION_HEADER, flush=True)
        rows = validate(check=args.check, device=args.on,
                        progress=lambda row: print(format_validation_row(row), flush=True))
        worst = worst_errors(rows)
        where = "on the CPU (exact tracker)" if args.on == "cpu" else "on CUDA (the caching allocator)"
        print(f"{len(rows)} configurations {where}; worst relative error per term: "
              + ", ".join(f"{term} {value:.2e}" for term, value in worst.items()))
        return 0 if args.on == "cuda" or not any(worst.values()) else 1
    try:
        model = _model_from_args(args, parser)
        setup = TrainingSetup(micro_batch=args.micro_batch, seq_len=args.seq_len, precision=args.precision,
                              optimizer=args.optimizer, optimizer_impl=args.impl, checkpointing=args.checkpointing,
                              lora_rank=args.lora_rank, lora_targets=args.lora_targets, chunked_loss=args.chunked_loss,
                              accumulation_steps=args.accumulation, strategy=args.strategy, ranks=args.ranks,
                              device=args.device)
        breakdown = predict(model, setup)
    except ValueError as error:
        parser.error(str(error))
    if args.device_gb < 0:
        parser.error(f"--device-gb must be >= 0 (0 skips the verdict), got {args.device_gb}")
    device_bytes = int(args.device_gb * 10**9) or None
    print(format_table(breakdown, device_bytes=device_bytes))
    if device_bytes:
        largest = largest_micro_batch(model, setup, device_bytes)
        if largest:
            print(f"largest micro-batch of {setup.seq_len} tokens that fits: {largest}")
        else:
            state = breakdown.parameters + breakdown.gradients + breakdown.optimizer_state
            print(f"no micro-batch fits: at the peak, parameters, gradients and optimizer state alone take "
                  f"{_gib(state)} GiB of the {_gib(device_bytes)} GiB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
