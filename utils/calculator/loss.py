"""The losses, replayed: a transformers causal LM's (``labels=``, your own on the logits, notebook 17's summed loss
over the count) and the chunked loss (``utils.chunked_cross_entropy``, notebook 08), head and loss chunk by chunk."""

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


class _HfLoss:
    """Mixin of ``_Step``: the loss of a transformers causal LM, as ``TrainingSetup.loss`` says the step computes it.

    * ``"labels"``: ``model(..., labels=labels).loss`` (``ForCausalLMLoss``): ``logits.float()``, the labels
      padded by one and shifted (a contiguous copy that ``nll_loss`` keeps), the mean over the targets;
    * ``"logits"``: ``F.cross_entropy(model(...).logits.flatten(0, 1).float(), targets.flatten())``;
    * ``"shifted-sum"``: notebook 17's ``train_step``: ``count = (labels[:, 1:] != -100).sum()`` and
      ``total = torch.zeros(())`` before the first micro-batch, then per micro-batch
      ``loss = F.cross_entropy(logits[:, :-1].flatten(0, -2), labels[:, 1:].flatten(), reduction="sum") / count``
      (the slice's ``flatten`` copies the logits but the last position; the division comes after the model's
      output is dropped), ``loss.backward()``, ``total += loss.detach()``; each ``loss`` lives until the next
      one replaces it, the last (and ``count`` and ``total``) until the step returns.
    """

    def hf_step_begin(self) -> None:
        """What the step allocates before its first micro-batch: notebook 17's count of targets and running total."""
        self.hf_last_loss: _T | None = None
        if self.setup.loss != "shifted-sum":
            return
        rows = self.setup.micro_batch * self.setup.accumulation_steps
        valid = self.new(rows * (self.setup.seq_len - 1), 1, "temporaries", "labels[:, 1:] != -100")
        self.hf_count = self.new(1, 8, "loss", "count of targets (.sum())")
        self.rel(valid)
        self.hf_total = self.new(1, 4, "loss", "running total (zeros(()))")

    def hf_loss(self, logits: _T, output: list[_T | None]) -> _T:
        """The loss on the (tokens, vocab) logits. ``output``: what the model's output object holds besides the
        logits (the last hidden state, the cache's tensors), released where the reader's step drops it: after
        the loss for ``labels=`` (computed inside the forward), before it for your own loss."""
        n_tok, b, t = self.setup.tokens, self.setup.micro_batch, self.setup.seq_len
        if self.setup.loss != "labels":               # forward returned: its locals (the last hidden state) go,
            self.rel(output[0])                       # and with `.logits` taken, the output object (the cache)
            if self.setup.loss == "logits":
                self.rel(*output[1:])
        if self.setup.loss == "shifted-sum":
            rows = b * (t - 1)
            n = self.node("SliceBackward logits[:, :-1]", [(logits, "alloc")])   # backward: zeros, then a copy
            sliced = self.output(self.view(logits, rows * self.model.vocab_size), n)
            n = self.node("CloneBackward .flatten(0, -2)", [(sliced, "pass")])  # not viewable: reshape copies
            flat = self.output(self.new(sliced.numel, logits.item, "loss", "logits[:, :-1].flatten(0, -2)"), n)
            self.rel(sliced)
            targets = self.new(rows, 8, "loss", "labels[:, 1:].flatten()")
            # autocast runs cross_entropy in float32: bf16 logits are cast first (a copy, freed with the call)
            upcast = self.to_float(flat, "autocast's float32 logits") if self.autocast else self.view(flat)
            summed = self.cross_entropy(upcast, rows, target=targets)
            self.rel(upcast, flat, targets, *output[1:], logits)  # loss_sum returns: the output object goes
            loss = self.div_scalar(summed, "loss / count")
            self.rel(summed, self.hf_last_loss)          # `loss = ...` replaces the previous micro-batch's loss
            self.hf_last_loss = loss
            self.incref(loss.buf)
            return loss
        upcast = self.to_float(logits, "logits.float()")
        if self.setup.loss == "labels":
            padded = self.new(b * (t + 1), 8, "loss", "F.pad(labels, (0, 1))")
            # labels[..., 1:].contiguous(): a copy, unless one sequence makes the slice contiguous already
            shifted = self.new(n_tok, 8, "loss", "shift_labels (contiguous)") if b > 1 else self.view(padded, n_tok)
            loss = self.cross_entropy(upcast, n_tok, target=shifted)
            self.rel(padded, shifted, upcast, *output, logits)   # the output object goes after the forward
        else:
            loss = self.cross_entropy(upcast, n_tok)
            self.rel(upcast, logits)
        return loss

    def hf_backward(self, micro: int, loss: _T) -> None:
        """``(loss / accumulation_steps).backward()``, or notebook 17's ``loss.backward()`` (its loss already
        divided by the count, and kept until the next micro-batch's replaces it)."""
        shifted = self.setup.loss == "shifted-sum"
        self.backward_loss(micro, loss, divide=self.setup.accumulation_steps > 1 and not shifted)
