"""The losses, replayed: a transformers causal LM's (``labels=``, your own on the logits, notebook 17's summed loss
over the count, and what the reader's loop keeps of the output) and the chunked loss
(``utils.chunked_cross_entropy``, notebook 08), head and loss chunk by chunk."""

from __future__ import annotations

from typing import Callable

from .replay import _Node, _Replay, _T


class _ChunkedLoss:
    """Mixin of ``_Step``: the forward of ``chunked_cross_entropy`` and its recomputing backward."""

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
            n.custom = self.chunked_loss_backward(hidden, w, b, self.autocast)
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

    def chunked_loss_backward(self, hidden: _T, w: _T, b: _T | None, autocast: bool = False) -> Callable[..., list]:
        """Its backward; ``autocast``: forward ran under autocast, so each chunk's logits are recomputed under it
        (bf16 copies of the bias, the weight (cached until the chunk's autocast block exits) and the chunk)."""
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
                if autocast:
                    copies = [r.new(t.numel if t is not hidden else c * d, 2, "temporaries", "bf16 copy")
                              for t in ((b,) if b is not None else ()) + (w, hidden) if t.item != 2]
                    low = r.new(c * v, 2, "temporaries", "chunk logits bf16 (recomputed)")
                    if hidden.item != 2:
                        r.rel(copies.pop())               # the chunk's copy dies with F.linear
                    logits = r.new(c * v, 4, "temporaries", "chunk logits.float()")
                    r.rel(low, *copies)                  # then leaving autocast frees the cached weight copies
                else:
                    logits = r.new(c * v, w.item, "temporaries", "chunk logits (recomputed)")
                if w.item != 4 and not autocast:
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


def transformers_step_begin(r) -> None:  # noqa: ANN001 - the replay
    """What the step allocates before its first micro-batch: notebook 17's count of targets and running total."""
    r.hf_last_loss = None
    if r.setup.loss != "shifted-sum":
        return
    rows = r.setup.micro_batch * r.setup.accumulation_steps
    valid = r.new(rows * (r.setup.seq_len - 1), 1, "temporaries", "labels[:, 1:] != -100")
    r.hf_count = r.new(1, 8, "loss", "count of targets (.sum())")
    r.rel(valid)
    r.hf_total = r.new(1, 4, "loss", "running total (zeros(()))")


def transformers_loss(r, micro: int, logits: _T, final: _T, cache: list[_T]) -> _T:  # noqa: ANN001
    """The loss of a transformers causal LM on its (tokens, vocab) logits, as ``TrainingSetup.loss`` computes it,
    and the output object as the reader's loop keeps it (``TrainingSetup.outputs``).

    * ``"labels"``: ``model(..., labels=labels).loss`` (``ForCausalLMLoss``, inside the model's forward):
      ``logits.float()``, the labels padded by one and shifted (a contiguous copy that ``nll_loss`` keeps), the
      mean over the targets. Kept: ``outputs = model(...)`` holds the loss, the logits and the cache.
    * ``"logits"``: ``F.cross_entropy(model(...).logits.flatten(0, 1).float(), targets.flatten())``. Kept:
      ``logits = model(...).logits`` holds the logits (the rest of the output goes at once), and the ``loss``
      variable its loss until the next loss replaces it.
    * ``"shifted-sum"``: notebook 17's ``train_step``: ``count = (labels[:, 1:] != -100).sum()`` and
      ``total = torch.zeros(())`` before the first micro-batch, then per micro-batch
      ``loss = F.cross_entropy(logits[:, :-1].flatten(0, -2), labels[:, 1:].flatten(), reduction="sum") / count``
      (the slice's ``flatten`` copies the logits but the last position; the division comes after the model's
      output is dropped), ``loss.backward()``, ``total += loss.detach()``; each ``loss`` lives until the next
      one replaces it, the last (and ``count`` and ``total``) until the step returns. Kept: ``outputs = model(...)``
      holds the logits and the cache.

    ``final`` (the model's last hidden state, a local of its forward) goes when the forward returns. Phases:
    ``m<i>.head`` holds the model's forward (and the ``labels=`` loss), ``m<i>.outputs`` the rebinding of the
    loop's variable (the previous micro-batch's or step's outputs go), ``m<i>.loss`` the reader's own loss.
    """
    setup = r.setup
    n_tok, b, t = setup.tokens, setup.micro_batch, setup.seq_len
    keep = r.family.outputs(setup) != "dropped"
    if setup.loss == "labels":
        upcast = r.to_float(logits, "logits.float()")
        padded = r.new(b * (t + 1), 8, "loss", "F.pad(labels, (0, 1))")
        # labels[..., 1:].contiguous(): a copy, unless one sequence makes the slice contiguous already
        shifted = r.new(n_tok, 8, "loss", "shift_labels (contiguous)") if b > 1 else r.view(padded, n_tok)
        loss = r.cross_entropy(upcast, n_tok, target=shifted)
        r.rel(padded, shifted, upcast, final)
        r.set_phase(f"m{micro}.outputs")
        if keep:                                   # outputs = model(...): the loss, the logits and the cache
            r.hold("outputs", [loss, logits, *cache])
        r.rel(*cache, logits)                      # the output object goes after the forward (or is held)
        r.set_phase(f"m{micro}.loss")
        return loss
    r.rel(final)                                   # the forward returned: its locals (the last hidden state) go
    r.set_phase(f"m{micro}.outputs")
    if keep:
        r.hold("outputs", [logits] if setup.loss == "logits" else [logits, *cache])
    if setup.loss == "logits":                     # `.logits` taken at once: the output object (the cache) goes
        r.rel(*cache)
    r.set_phase(f"m{micro}.loss")
    if setup.loss == "shifted-sum":
        rows = b * (t - 1)
        n = r.node("SliceBackward logits[:, :-1]", [(logits, "alloc")])   # backward: zeros, then a copy
        sliced = r.output(r.view(logits, rows * r.model.vocab_size), n)
        n = r.node("CloneBackward .flatten(0, -2)", [(sliced, "pass")])  # not viewable: reshape copies
        flat = r.output(r.new(sliced.numel, logits.item, "loss", "logits[:, :-1].flatten(0, -2)"), n)
        r.rel(sliced)
        targets = r.new(rows, 8, "loss", "labels[:, 1:].flatten()")
        # autocast runs cross_entropy in float32: bf16 logits are cast first (a copy, freed with the call)
        upcast = r.to_float(flat, "autocast's float32 logits") if r.autocast else r.view(flat)
        summed = r.cross_entropy(upcast, rows, target=targets)
        r.rel(upcast, flat, targets, *cache, logits)   # loss_sum returns: the output object goes (or is held)
        r.set_phase(f"m{micro}.count")
        loss = r.div_scalar(summed, "loss / count")
        r.rel(summed, r.hf_last_loss)              # `loss = ...` replaces the previous micro-batch's loss
        r.hf_last_loss = loss
        r.incref(loss.buf)
        return loss
    upcast = r.to_float(logits, "logits.float()")
    loss = r.cross_entropy(upcast, n_tok)
    if keep:                                       # `loss = ...` replaces the previous loss only now
        r.set_phase(f"m{micro}.lossvar")
        r.hold("loss", [loss])
    r.rel(upcast, logits)
    return loss
