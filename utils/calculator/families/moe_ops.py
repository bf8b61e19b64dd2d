"""The aten ops of transformers' sparse MoE block and of peft's LoRA on the experts, as allocations and autograd
records (``moe.py`` composes them): ``topk``, the router weights' in-place renormalisation, indexing, grouped
matmuls, ``baddbmm``. Each does what torch 2.13 does on the CPU, allocation by allocation, checked against the
storage counter and MemTracker through the transformers grid (``hf_grid.py``)."""

from __future__ import annotations

from ..replay import _Node, _Replay, _T


def topk(r: _Replay, probs: _T, k: int, label: str) -> tuple[_T, _T]:
    """``torch.topk(probs, k)``: values and int64 indices; backward scatters into zeros of the input's size."""
    rows = probs.numel // r.model.setting("experts")
    n = r.node(f"TopkBackward {label}", [(probs, "custom")])
    values = r.output(r.new(rows * k, probs.item, "activations", f"{label} top-k weights"), n)
    indices = r.new(rows * k, 8, "activations", f"{label} top-k experts")
    r.save(n, indices)
    if n is not None:
        def backward(r_: _Replay, node: _Node, incoming: list) -> list:
            zeros = r_.new(probs.numel, probs.item, "temporaries", f"{label} topk backward zeros")
            grad = r_.new(probs.numel, probs.item, r_._grad_kind(probs), f"grad {label} topk")
            r_.rel(zeros)
            return [grad]
        n.custom = backward
    return values, indices


def renormalise(r: _Replay, values: _T, k: int, label: str) -> _T:
    """``router_top_value /= router_top_value.sum(dim=-1, keepdim=True)``: the sum (saved), autograd's copy of the
    weights before the in-place division (saved); backward computes the sum's gradient first (four temporaries),
    then the weights', then sums the first down to the sum's shape."""
    rows = values.numel // k
    n_sum = r.node(f"SumBackward {label} sum", [(values, "view")])
    total = r.output(r.new(rows, values.item, "activations", f"{label} sum of the top-k"), n_sum)
    original = r.new(values.numel, values.item, "activations", f"{label} top-k before /=")
    n = r.node(f"DivBackward {label} /=", [(values, "custom"), (total, "custom")], saved=[original, total])
    if n is not None:
        def backward(r_: _Replay, node: _Node, incoming: list) -> list:
            size, item = values.numel, values.item
            scratch = [r_.new(size, item, "temporaries", f"{label} /= backward {what}")
                       for what in ("self / other", "/ other", "-grad")]
            other = r_.new(size, item, "temporaries", f"grad {label} sum (unreduced)")
            r_.rel(scratch[2], scratch[1], scratch[0])
            grad = r_.new(size, item, r_._grad_kind(values), f"grad {label} top-k")
            return [grad, other]                         # the engine sums `other` down to (T, 1)
        n.custom = backward
    after = r.output(r.view(values), n)                 # the same storage, now the quotient
    r.rel(values, original, total)
    return after


def index(r: _Replay, src: _T, index: _T, rows: int, width: int, label: str) -> _T:
    """``src[index]`` along dim 0: ``rows`` rows of ``width``; backward writes the gradient into zeros (index_put)."""
    n = r.node(f"IndexBackward {label}", [(src, "custom")], saved=[index])
    out = r.output(r.new(rows * width, src.item, "activations", label), n)
    if n is not None:
        def backward(r_: _Replay, node: _Node, incoming: list) -> list:
            zeros = r_.new(src.numel, src.item, "temporaries", f"{label} backward zeros")
            grad = r_.new(src.numel, src.item, r_._grad_kind(src), f"grad {label}")
            r_.rel(zeros)
            return [grad]
        n.custom = backward
    return out


def grouped_mm(r: _Replay, x: _T, weight: _T, offsets: _T, rows: int, width: int, label: str) -> _T:
    """``F.grouped_mm(x, weight.transpose(-2, -1), offs=offsets)``: ``width`` outputs per row, in x's dtype (no
    autocast); autograd keeps x for the weight's gradient, the weight for x's (a parameter's view, or peft's merged
    copy), and the offsets; backward allocates the weight's gradient (every expert), then x's."""
    wv = r.view(weight)
    n = r.node(f"GroupedMmBackward {label}", [(x, "alloc"), (wv, "alloc")], order=[1, 0],
               saved=([x] if wv.rg else []) + ([wv] if x.rg else []) + [offsets])
    out = r.output(r.new(rows * width, x.item, "activations", label), n)
    r.rel(wv)
    return out


def baddbmm(r: _Replay, base: _T, lhs: _T, rhs: _T, label: str, grad: bool = True) -> _T:
    """``torch.baddbmm(W, lhs, rhs, alpha=scaling)`` with W frozen: the merged weight, W's size and dtype; autograd
    keeps each factor for the other's gradient; backward: ``grad @ rhs^T`` then ``* alpha`` for lhs (the bmm's output
    freed), the same for rhs."""
    grad_was, r.grad_enabled = r.grad_enabled, grad and r.grad_enabled
    n = r.node(f"BaddbmmBackward {label}", [(lhs, "custom"), (rhs, "custom")],
               saved=([rhs] if lhs.rg else []) + ([lhs] if rhs.rg else []))
    out = r.output(r.new(base.numel, base.item, "activations", label), n)
    r.grad_enabled = grad_was
    if n is not None:
        def backward(r_: _Replay, node: _Node, incoming: list) -> list:
            grads = []
            for factor, what in ((lhs, "lhs"), (rhs, "rhs")):
                if not factor.rg:
                    grads.append(None)
                    continue
                product = r_.new(factor.numel, base.item, "temporaries", f"{label} grad {what} bmm")
                grads.append(r_.new(factor.numel, base.item, r_._grad_kind(factor), f"grad {label} {what}"))
                r_.rel(product)
            return grads
        n.custom = backward
    return out
