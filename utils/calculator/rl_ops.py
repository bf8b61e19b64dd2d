"""The RL step's own ops (notebook 15): ``completion_logprobs`` and GRPO's loss (``utils.generation``'s recipe),
op by op as autograd records and runs them: log-softmax, gather, log-sum-exp, the chunks' split and cat, the loss's
sums and divisions. A mixin of the replayed step (``rl._GRPO``), kept apart so that each module is one sitting.
"""

from __future__ import annotations

from typing import Any

from .replay import _Node, _Replay, _T


class _RLOps:
    """Mixin of ``rl._GRPO``: the recipe's functions, on the replay's tensors (``r.family`` runs the model)."""

    # -- the recipe's functions --------------------------------------------------------------------------------
    def completion_logprobs(self, rows: int, rl: Any, micro: int) -> _T:
        """``completion_logprobs(model, sequences[part], P, chunk)``: (rows, N) fp32 log-probabilities."""
        p, n, v = rl.prompt_length, rl.new_tokens, self.model.vocab_size
        self.micro = micro
        self.shaped(rows, p + n)
        logits, final, _ = self.family.forward_logits(self, micro, keep=n + 1)
        self.rel(final)                                  # the output object goes; .logits is kept
        sliced = self.slice_view(logits, rows * n * v, "logits[:, :-1]")
        if not rl.chunk:
            up = self.to_float(sliced, "logits.float()", "loss")
            logsoft = self.log_softmax(up, "log_softmax")
            self.rel(up)
            picked = self.gather(logsoft, rows * n, "gather")
            self.rel(logsoft, sliced, logits)
            return picked
        pieces = []
        sizes = [min(rl.chunk, n - start) for start in range(0, n, rl.chunk)]
        up = None
        for size, piece in zip(sizes, self.split(sliced, [rows * size * v for size in sizes], "logits.split(chunk)")):
            self.rel(up)                                 # the loop rebinds `piece`: the previous fp32 piece goes
            up = self.to_float(piece, "piece.float()", "loss")
            self.rel(piece)
            picked = self.gather(up, rows * size, "piece.gather")
            lse = self.logsumexp(up, rows * size, "piece.logsumexp")
            pieces.append(self.sub(picked, lse, "gather - logsumexp"))
            self.rel(picked, lse)
        out = self.cat(pieces, "torch.cat(pieces)")      # the last fp32 piece is alive until the function returns
        self.rel(*pieces, up, sliced, logits)
        return out

    def split(self, x: _T, numels: list[int], label: str) -> list[_T]:
        """``x.split(chunk, dim)``: views, one autograd node for all of them; backward concatenates their gradients
        (one ``cat`` of x's size, once every piece's gradient has arrived)."""
        n = self.node(f"SplitBackward {label}", [(x, "alloc")], slots=len(numels))
        parts = [self.output(self.view(x, numel), n, slot) for slot, numel in enumerate(numels)]
        if n is not None:
            n.custom = lambda r, node, incoming: [r.new(x.numel, x.item, "temporaries", f"cat {label}")]
        return parts

    def log_softmax(self, x: _T, label: str) -> _T:
        """``x.log_softmax(-1)``: the output, saved for backward."""
        n = self.node(f"LogSoftmaxBackward {label}", [(x, "alloc")])
        out = self.output(self.new(x.numel, x.item, "loss", label), n)
        self.save(n, out)
        return out

    def gather(self, x: _T, numel: int, label: str) -> _T:
        """``x.gather(-1, index).squeeze(-1)`` (the index: a view of the sequences, alive anyway); it saves x (a
        view of the logits, in fp32 chunks: they stay until the last chunk's gather has run backward); backward
        scatters into zeros of x's size (``new_zeros``, then an out-of-place ``scatter_add``)."""
        n = self.node(f"GatherBackward {label}", [(x, "custom")], saved=[x])     # gather_backward reads self
        out = self.output(self.new(numel, x.item, "loss", label), n)
        if n is not None:
            def backward(r: _Replay, node: _Node, incoming: list) -> list:
                zeros = r.new(x.numel, x.item, "temporaries", "new_zeros")
                grad = r.new(x.numel, x.item, r._grad_kind(x), "scatter_add")
                r.rel(zeros)
                return [grad]
            n.custom = backward
        return out

    def logsumexp(self, x: _T, numel: int, label: str) -> _T:
        """``x.logsumexp(-1)``: saves its input and its result; backward ``grad * (x - result).exp()``."""
        n = self.node(f"LogsumexpBackward {label}", [(x, "custom")], saved=[x])
        out = self.output(self.new(numel, 4, "loss", label), n)
        self.save(n, out)
        if n is not None:
            def backward(r: _Replay, node: _Node, incoming: list) -> list:
                diff = r.new(x.numel, 4, "temporaries", "self - result")
                exp = r.new(x.numel, 4, "temporaries", ".exp()")
                grad = r.new(x.numel, 4, r._grad_kind(x), "grad * exp")
                r.rel(diff, exp)                         # the expression's temporaries go after the product
                return [grad]
            n.custom = backward
        return out

    def sub(self, a: _T, b: _T | None, label: str, numel: int | None = None) -> _T:
        """``a - b`` (b None: a scalar): the first's gradient passes, the second's is negated (an allocation)."""
        numel = numel or max(a.numel, b.numel if b is not None else 0)
        edges = [(a, "pass")] + ([(b, "custom")] if b is not None else [])
        n = self.node(f"SubBackward {label}", edges)
        out = self.output(self.new(numel, 4, "loss", label), n)
        if n is not None:
            def backward(r: _Replay, node: _Node, incoming: list) -> list:
                grads: list = [None] * len(node.edges)
                if a.rg:
                    grads[0] = r.view(incoming[0])
                if b is not None and b.rg:
                    grads[1] = r.new(incoming[0].numel, 4, r._grad_kind(b), f"-grad {label}")
                return grads
            n.custom = backward
        return out

    def cat(self, parts: list[_T], label: str) -> _T:
        """``torch.cat(parts, dim=1)``: backward hands each part a view of the gradient."""
        n = self.node(f"CatBackward {label}", [(t, "view") for t in parts])
        return self.output(self.new(sum(t.numel for t in parts), 4, "loss", label), n)

    def total(self, x: _T, numel: int, label: str) -> _T:
        """``x.sum(dim)`` or ``x.sum()``: backward expands the gradient back (a view, no allocation)."""
        n = self.node(f"SumBackward {label}", [(x, "custom")])
        out = self.output(self.new(numel, x.item, "loss", label), n)
        if n is not None:
            n.custom = lambda r, node, incoming: [r.view(incoming[0], x.numel)]
        return out

    def divide(self, a: _T, b: _T, label: str) -> _T:
        """``a / b``, b without gradient: saves b; backward ``grad / b``."""
        n = self.node(f"DivBackward {label}", [(a, "alloc")], saved=[b])
        return self.output(self.new(a.numel, 4, "loss", label), n)

    def grpo_loss(self, logprobs: _T, frozen: _T | None, advantages: _T, mask: _T, rl: Any) -> _T:
        """``grpo_loss(logprobs, reference_logprobs, advantages, mask, beta, total_rows)``, op by op."""
        detached = _T(logprobs.buf, logprobs.numel, logprobs.item)          # logprobs.detach(): the same storage
        self.incref(detached.buf)
        diff = self.sub(logprobs, detached, "logp - logp.detach()")
        self.rel(detached)
        ratio = self.unary(diff, "Exp", "exp(...)", save_output=True)
        self.rel(diff)
        per_token = self.mul(ratio, advantages, "* advantages", numel=ratio.numel)
        self.rel(ratio)
        delta = None
        if frozen is not None and rl.beta:
            delta = self.sub(frozen, logprobs, "delta = ref - logp", numel=logprobs.numel)
            e = self.unary(delta, "Exp", "exp(delta)", save_output=True)
            minus = self.sub(e, delta, "exp(delta) - delta")
            self.rel(e)
            kl = self.sub(minus, None, "- 1")
            self.rel(minus)
            scaled = self.mul_scalar(kl, "beta * kl")
            self.rel(kl)
            new = self.sub(per_token, scaled, "per_token - beta * kl")
            self.rel(scaled, per_token)
            per_token = new
        masked = self.mul(per_token, mask, "* mask", numel=per_token.numel)
        rows = logprobs.numel // rl.new_tokens
        sums = self.total(masked, rows, ".sum(1)")
        self.rel(masked)
        counts = self.new(rows, 4, "loss", "mask.sum(1)")
        divided = self.divide(sums, counts, "/ mask.sum(1)")
        self.rel(sums, counts)
        whole = self.total(divided, 1, ".sum()")
        self.rel(divided)
        negative = self.neg(whole, "-(...)")
        self.rel(whole)
        loss = self.div_scalar(negative, "/ total_rows")
        self.rel(negative)
        self.rel(per_token, delta)                       # grpo_loss returns: its locals go
        return loss
