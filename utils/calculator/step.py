"""One training step of ``reference_step`` for a model and set-up, replayed: embeddings, blocks, loss, optimizer."""

from __future__ import annotations

from typing import Callable

from .config import ModelConfig, TrainingSetup
from .dataparallel import _DataParallel
from .gpt import _GptBlock
from .hf_gpt2 import _HfGpt2
from .hf_llama import _HfLlama, hf_leaf_item
from .llama import _LlamaBlock
from .loss import _ChunkedLoss, _HfLoss
from .ops import _Ops
from .optimizers import _optimizer_state_per_rank, _optimizer_temporaries, _shard_leaves
from .replay import _Buf, _Leaf, _Region, _Replay, _T
from .shapes import _linears, _lora_on, parameter_shapes


class _Step(_GptBlock, _LlamaBlock, _HfLlama, _HfGpt2, _HfLoss, _ChunkedLoss, _DataParallel, _Ops):
    """One step of ``reference_step`` for a model and set-up, replayed op by op."""

    def __init__(self, model: ModelConfig, setup: TrainingSetup, trace: bool = False) -> None:
        super().__init__(setup.device, trace)
        self.model, self.setup = model, setup
        item = 2 if setup.precision == "bf16" else 4
        self.leaves = {name: _Leaf(name, shape, hf_leaf_item(name, setup) if model.is_hf else item, trainable)
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

    def backward_loss(self, micro: int, loss: _T, divide: bool = True) -> None:
        """``(loss / accumulation_steps).backward()`` (the division is skipped where ``divide`` is False)."""
        self.set_phase(f"m{micro}.bloss")
        scaled = self.div_scalar(loss, "loss / accumulation_steps") if divide else self.view(loss)
        self.backward(scaled)
        self.after_backward()
        self.rel(scaled, loss)

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
        if model.is_hf:
            self.hf_buffers()
        self.state_buf = self._alloc(_optimizer_state_per_rank(model, setup), "optimizer_state", "optimizer state")
        self.incref(self.state_buf)
        if setup.strategy in ("ddp", "zero1"):  # DDP's gradient buckets (gradient_as_bucket_view=False)
            buckets = sum(leaf.numel * leaf.item for leaf in self.leaves.values() if leaf.trainable)
            self.incref(self._alloc(buckets, "comm_buffers", "DDP gradient buckets"))
        arrays = 3 if model.is_hf and setup.padded else 2      # token ids, targets (or labels), attention mask
        batch = self._alloc(arrays * 8 * setup.tokens * setup.accumulation_steps, "inputs", "token ids and targets")
        self.incref(batch)
        self.baseline = self.current
        if model.is_hf:
            self.hf_step_begin()
        # micro-batches after the second repeat it exactly (same state, same gradients alive): replay two
        for micro in range(min(setup.accumulation_steps, 2)):
            self.micro = micro
            self.set_phase(f"m{micro}.embed")
            if setup.precision == "bf16-autocast":
                self.autocast, self.cache = True, {}
            if model.is_hf:
                self.hf_micro_batch(micro)
                continue
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
            self.backward_loss(micro, loss)
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
