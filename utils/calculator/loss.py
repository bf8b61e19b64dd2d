"""The chunked loss (``utils.chunked_cross_entropy``, notebook 08), replayed: head and loss chunk by chunk."""

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
