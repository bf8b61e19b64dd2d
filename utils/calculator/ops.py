"""The aten ops the replayed steps use, each with its forward allocations and its autograd record."""

from __future__ import annotations

from .replay import _Node, _Replay, _T

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

    def sdpa(self, q: _T, k: _T, v: _T, lse_numel: int, label: str, mask_numel: int | None = None) -> _T:
        """``F.scaled_dot_product_attention``, flash kernel: output and fp32 logsumexp are saved. With a bool
        mask (``mask_numel`` elements) the kernel first makes a float one (``where(mask, 0, -inf)``, after
        autocast's casts), which it saves."""
        casts = []
        if self.autocast:
            v, k, q = (self.cast16(t, f"{label} {name} bf16") for t, name in ((v, "value"), (k, "key"), (q, "query")))
            casts = [v, k, q]
        floats = None
        if mask_numel is not None:
            zero, low = self.new(1, q.item, "temporaries", "0"), self.new(1, q.item, "temporaries", "-inf")
            floats = self.new(mask_numel, q.item, "activations", f"{label} float mask")
            self.rel(zero, low)
        n = self.node(f"SdpaBackward {label}", [(q, "alloc"), (k, "alloc"), (v, "alloc")],
                      saved=[q, k, v] + ([floats] if floats is not None else []))
        out = self.new(q.numel, q.item, "activations", label)
        lse = self.new(lse_numel, 4, "activations", f"{label} logsumexp")
        self.save(n, lse, out)
        self.output(out, n)
        self.rel(*casts)
        self.rel(lse, floats)
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

    def cross_entropy(self, logits: _T, tokens: int, target: _T | None = None) -> _T:
        """``F.cross_entropy`` = log_softmax (saves its output) + nll_loss (saves total_weight, and the target:
        pass it where it is not the batch's own tensor, which lives anyway)."""
        n = self.node("LogSoftmaxBackward", [(logits, "alloc")])
        lsm = self.output(self.new(logits.numel, logits.item, "loss", "log-probs"), n)
        self.save(n, lsm)
        n = self.node("NllLossBackward", [(lsm, "alloc")], saved=[lsm] + ([target] if target is not None else []))
        loss = self.new(1, logits.item, "loss", "loss")
        total_weight = self.new(1, logits.item, "loss", "total_weight")
        self.save(n, total_weight)
        self.output(loss, n)
        self.rel(lsm, total_weight)
        return loss

    def div_scalar(self, x: _T, label: str) -> _T:
        n = self.node(f"DivBackward {label}", [(x, "alloc")])
        return self.output(self.new(x.numel, x.item, "loss", label), n)

    def bmm(self, a: _T, b: _T, out_numel: int, label: str, layouts: tuple[str, str] = ("contiguous", "contiguous"),
            batch: int = 1) -> _T:
        """``torch.matmul`` of two 4-D tensors (B, H, ...): autocast casts both to bf16 (copies), then each operand
        whose (B, H) dims do not fold into one is copied by ``reshape`` (``layouts``: "contiguous", "permuted" (a
        transposed view's layout, kept by elementwise ops and casts), "expanded" (a stride-0 head dim, which a
        cast makes contiguous)); ``bmm`` saves what it multiplies."""
        temps = []
        operands = []
        for t, layout in ((a, layouts[0]), (b, layouts[1])):
            if self.autocast and t.item != 2:
                t = self.cast16(t, f"{label} operand bf16")
                temps.append(t)
                layout = "contiguous" if layout == "expanded" else layout
            if batch > 1 and layout != "contiguous":
                n = self.node(f"CloneBackward {label} reshape", [(t, "pass")])
                t = self.output(self.new(t.numel, t.item, "activations", f"{label} reshape copy"), n)
                temps.append(t)
            operands.append(t)
        a, b = operands
        n = self.node(f"BmmBackward {label}", [(a, "alloc"), (b, "alloc")], order=[1, 0],
                      saved=([b] if a.rg else []) + ([a] if b.rg else []))
        out = self.output(self.new(out_numel, max(a.item, b.item), "activations", label), n)
        self.rel(*temps)
        return out

    def softmax(self, x: _T, label: str) -> _T:
        """``F.softmax(x, dim=-1, dtype=torch.float32)``: a float32 copy first when x is not; saves its output."""
        up = self.to_float(x, f"{label} input .float()", "activations")
        n = self.node(f"SoftmaxBackward {label}", [(up, "alloc")])
        out = self.output(self.new(up.numel, 4, "activations", label), n)
        self.save(n, out)
        self.rel(up)
        return out

    def contiguous(self, x: _T, label: str, copy_grad: bool = False) -> _T:
        """``.transpose(1, 2).contiguous()`` of a contiguous tensor: a copy; its gradient passes through, or is
        copied where it arrives in a layout the producer's reshape cannot view (``copy_grad``)."""
        n = self.node(f"CloneBackward {label}", [(x, "alloc" if copy_grad else "pass")])
        return self.output(self.new(x.numel, x.item, "activations", label), n)

    def repeat_interleave(self, x: _T, n_rep: int, label: str) -> _T:
        """``x.repeat_interleave(n_rep, dim=-3)``: a copy with every key/value head repeated; backward sums them."""
        n = self.node(f"RepeatInterleaveBackward {label}", [(x, "alloc")])
        return self.output(self.new(x.numel * n_rep, x.item, "activations", label), n)

    def slice_view(self, x: _T, numel: int, label: str) -> _T:
        """``x[..., a:b]``: a view of ``numel`` elements; its backward writes the gradient into zeros of x's size."""
        n = self.node(f"SliceBackward {label}", [(x, "alloc")])
        return self.output(self.view(x, numel), n)

    def chunk2(self, x: _T, label: str) -> tuple[_T, _T]:
        """``x.chunk(2, dim=-1)``: two views; backward concatenates their gradients (``cat``)."""
        n = self.node(f"SplitBackward {label}", [(x, "alloc")], slots=2)
        parts = [self.output(self.view(x, x.numel // 2), n, slot) for slot in range(2)]
        if n is not None:
            def cat(r: _Replay, node: _Node, incoming: list) -> list:
                return [r.new(x.numel, x.item, "temporaries", f"cat {label}")]
            n.custom = cat
        return parts[0], parts[1]
