"""Optimizers: the state torch.optim (and ``utils.AdamW8bit``) keeps, and the temporaries of one ``step()``."""

from __future__ import annotations

import math

from typing import Any

from . import registry
from .config import ModelConfig, TrainingSetup
from .replay import _Leaf, _Replay, _T

def state_bytes(shapes: list[tuple[int, ...]], optimizer: str, block_size: int = 256) -> int:
    """Bytes of optimizer state for trainable tensors of these shapes, in fp32 (``utils.predict_optimizer_state_bytes``
    without torch): SGD none; momentum ``n``; Adam(W) ``2n`` and a 0-dim ``step``; Adafactor a factored second
    moment (``row_var``, ``col_var``) or, for a vector, a full one, and a ``step``; ``utils.AdamW8bit`` two uint8
    moments and an fp32 scale per ``block_size`` elements of each."""
    total = 0
    for dims in shapes:
        numel = math.prod(dims)
        if optimizer == "sgd_momentum":
            total += 4 * numel
        elif optimizer in ("adam", "adamw"):
            total += 8 * numel + 4
        elif optimizer == "adafactor":
            if len(dims) > 1:
                total += 4 * (math.prod(dims[:-1]) + math.prod(dims[:-2]) * dims[-1]) + 4
            else:
                total += 4 * numel + 4
        elif optimizer == "adamw8bit":
            total += 2 * numel + 2 * 4 * math.ceil(numel / block_size)
    return total


def _optimizer_state_bytes(model: ModelConfig, setup: TrainingSetup, ranks: int = 1) -> int:
    """Bytes of optimizer state on one device (of every tensor's FSDP shard when ``ranks`` > 1).

    torch.optim keeps its state in each parameter's dtype (peft's LoRA adapters stay float32 on a bf16 model, and
    so does their state); ``utils.AdamW8bit``'s is uint8 codes and fp32 scales whatever the parameter's."""
    family = registry.family_of(model.arch)
    trainable = [(name, shape) for name, shape, trains in family.parameter_shapes(model, setup) if trains]
    if setup.bf16_rounding != "nearest":       # utils.lowbit.AdamWBF16: m, v (and Kahan's c) in bf16, no step tensor
        return (3 if setup.bf16_rounding == "kahan" else 2) * 2 * sum(math.prod(shape) for _, shape in trainable)
    elements = steps = 0
    for name, shape in trainable:
        if ranks > 1:
            shape = (math.ceil(shape[0] / ranks),) + tuple(shape[1:])
        total = state_bytes([shape], setup.optimizer)
        step = 4 if setup.optimizer in ("adam", "adamw", "adafactor") else 0
        item = family.leaf_item(name, setup)
        per_element = total - step
        if setup.optimizer != "adamw8bit":
            per_element = per_element * item // 4   # torch.optim keeps its state in the parameter's dtype
        elements += per_element
        steps += step
    if setup.device == "cuda" and setup.optimizer_impl != "fused":
        steps = 0                                # torch.optim keeps `step` on the host unless fused or capturable
    codebooks = 4 * sum(ADAMW8BIT_CODEBOOKS) if setup.optimizer == "adamw8bit" else 0   # kept on the optimizer
    return elements + steps + codebooks


def _optimizer_state_per_rank(model: ModelConfig, setup: TrainingSetup) -> int:
    """Optimizer state on one rank: all of it (single, DDP), ZeRO's 1/N (ZeRO-1/2), or that of FSDP's shards.

    ZeRO-1/2 split the per-element state evenly (``ceil(K·Ψ / N)``) and the 4-byte step counters by whole
    tensors (``ceil(T / N)``), as ``utils.predict_zero_bytes_per_rank``; FSDP2 shards every tensor along
    dim 0 (padded), so each rank keeps the state of its shards and every step counter.
    """
    if setup.strategy in ("single", "ddp"):
        return _optimizer_state_bytes(model, setup)
    if setup.bf16_rounding != "nearest":  # pragma: no cover - TrainingSetup refuses sharding with it
        raise ValueError("bf16_rounding is modelled on one device or under DDP")
    if setup.strategy == "fsdp":
        return _optimizer_state_bytes(model, setup, ranks=setup.ranks)
    total = _optimizer_state_bytes(model, setup)
    tensors = sum(1 for _, _, trainable in registry.family_of(model.arch).parameter_shapes(model, setup) if trainable)
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
    if setup.bf16_rounding != "nearest":
        adamw_bf16_temporaries(r, leaves, setup.bf16_rounding)
        return
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


def adamw_bf16_temporaries(r: _Replay, leaves: list, rounding: str) -> None:
    """``utils.lowbit.AdamWBF16.step``, one parameter at a time: fp32 temporaries, some living on to the next.

    The loop's locals (``grad``, ``m``, ``v``, ``update``) are rebound per parameter, so each one of the
    previous parameter is freed only when its successor exists.
    """
    grad = m = v = update = None
    for leaf in leaves:
        n, item = leaf.numel, leaf.item

        def f32(label: str) -> _T | None:               # .float() of a bf16 tensor: a copy (of fp32: itself)
            return r.new(n, 4, "temporaries", label) if item != 4 else None

        new = r.new(n, 4, "temporaries", "grad.float()") if item != 4 else None
        r.rel(grad)
        grad = new
        for name in ("m", "v"):                           # s[name].float().lerp_(...) / .mul_().addcmul_()
            new = f32(f"{name}.float()")
            if name == "m":
                r.rel(m)
                m = new
            else:
                r.rel(v)
                v = new
        a = r.new(n, 4, "temporaries", "m / bias_correction1")
        scaled = r.new(n, 4, "temporaries", "-lr * m_hat")
        r.rel(a)
        c = r.new(n, 4, "temporaries", "v / bias_correction2")
        root = r.new(n, 4, "temporaries", "sqrt()")
        r.rel(c)
        denom = r.new(n, 4, "temporaries", "+ eps")
        r.rel(root)
        new = r.new(n, 4, "temporaries", "update")
        r.rel(scaled, denom, update)
        update = new
        weights = f32("p.float()")                        # update -= lr * weight_decay * p.float()
        decay = r.new(n, 4, "temporaries", "lr * weight_decay * p")
        r.rel(weights, decay)
        if rounding == "kahan":                           # add_kahan_(p, update, c)
            weights = f32("weight.float()")
            comp = f32("compensation.float()")
            total = r.new(n, 4, "temporaries", "update + compensation")
            r.rel(comp)
            exact = r.new(n, 4, "temporaries", "exact")
            r.rel(weights, total)
            weights = f32("weight.float()")
            rest = r.new(n, 4, "temporaries", "exact - weight")
            r.rel(weights, rest, exact)
        else:
            weights = f32("p.float()")
            exact = r.new(n, 4, "temporaries", "p + update")
            r.rel(weights)
            if rounding == "stochastic":                  # round_stochastic(exact)
                noise = r.new(n, 4, "temporaries", "noise")
                summed = r.new(n, 4, "temporaries", "bits + noise")
                cut = r.new(n, 4, "temporaries", "& -65536")
                r.rel(summed)
                rounded = r.new(n, 2, "temporaries", ".to(bfloat16)")
                r.rel(cut, noise, exact, rounded)
            else:
                r.rel(exact)
    r.rel(grad, m, v, update)


# torch.optim's (and utils.AdamW8bit's) constructor arguments: what each does to training memory
_NO_EFFECT = {"lr": "a number the update multiplies by", "betas": "numbers the moments decay by",
              "eps": "a number added in place", "dampening": "SGD's momentum scales in place",
              "beta2_decay": "Adafactor's decay schedule, a number", "d": "Adafactor's clipping threshold, a number"}
OPTIMIZER_OPTIONS: dict[str, dict[str, Any]] = {
    # optimizer -> {"replayed": {name: how}, "no_effect": {name: why}, "refused": {name: default}}
    "sgd": {"replayed": {"momentum": "0 (with momentum: optimizer 'sgd_momentum')",
                         "foreach": "optimizer_impl", "fused": "optimizer_impl"},
            "no_effect": {k: _NO_EFFECT[k] for k in ("lr", "dampening")},
            "refused": {"weight_decay": 0, "nesterov": False, "maximize": False, "differentiable": False}},
    "adam": {"replayed": {"foreach": "optimizer_impl", "fused": "optimizer_impl"},
             "no_effect": {k: _NO_EFFECT[k] for k in ("lr", "betas", "eps")} | {
                 "decoupled_weight_decay": "with it, weight decay multiplies the weights in place (AdamW)"},
             "refused": {"weight_decay": 0, "amsgrad": False, "maximize": False, "capturable": False,
                         "differentiable": False}},
    "adamw": {"replayed": {"foreach": "optimizer_impl", "fused": "optimizer_impl"},
              "no_effect": {k: _NO_EFFECT[k] for k in ("lr", "betas", "eps")} | {
                  "weight_decay": "AdamW multiplies the weights in place", "decoupled_weight_decay": "always on"},
              "refused": {"amsgrad": False, "maximize": False, "capturable": False, "differentiable": False}},
    "adafactor": {"replayed": {"foreach": "optimizer_impl"},
                  "no_effect": {k: _NO_EFFECT[k] for k in ("lr", "beta2_decay", "eps", "d")} | {
                      "weight_decay": "Adafactor multiplies the weights in place"},
                  "refused": {"maximize": False}},
    "adamw8bit": {"replayed": {},
                  "no_effect": {k: _NO_EFFECT[k] for k in ("lr", "betas", "eps")} | {
                      "weight_decay": "utils.AdamW8bit multiplies the weights in place"},
                  "refused": {"block_size": ADAMW8BIT_BLOCK}},
}
OPTIMIZER_OPTIONS["sgd_momentum"] = {**OPTIMIZER_OPTIONS["sgd"],
                                     "replayed": {**OPTIMIZER_OPTIONS["sgd"]["replayed"],
                                                  "momentum": "> 0 (optimizer 'sgd_momentum')"}}


def check_optimizer_options(setup: TrainingSetup) -> None:
    """Refuse an optimizer option that changes memory in a way the replay does not model, or contradicts the set-up.

    Raises:
        ValueError: naming the option, its value and what was expected.
    """
    rules = OPTIMIZER_OPTIONS[setup.optimizer]
    for name, value in setup.optimizer_options:
        if name in rules["refused"]:
            if value != rules["refused"][name]:
                raise ValueError(f"optimizer option {name}={value!r} is not modelled (it changes what "
                                 f"{setup.optimizer}'s step allocates): expected {rules['refused'][name]!r}")
        elif name in ("foreach", "fused"):
            if value and setup.optimizer_impl != name or (value is False and setup.optimizer_impl == name):
                raise ValueError(f"optimizer option {name}={value!r} contradicts optimizer_impl "
                                 f"{setup.optimizer_impl!r}: expected optimizer_impl {name!r} with {name}=True")
        elif name == "momentum":
            wanted = "sgd_momentum" if value else "sgd"
            if setup.optimizer != wanted:
                raise ValueError(f"optimizer option momentum={value!r} is optimizer {wanted!r}: expected "
                                 f"optimizer={wanted!r}, got {setup.optimizer!r}")
        elif name not in rules["no_effect"]:
            known = sorted({*rules["replayed"], *rules["no_effect"], *rules["refused"]})
            raise ValueError(f"optimizer option {name!r} is not an argument of {setup.optimizer} the calculator "
                             f"knows: expected one of {known}")
