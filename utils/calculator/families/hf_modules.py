"""transformers' shared modules, replayed as allocations: the norms, the rotary embedding, the masks, attention
(sdpa, eager, sdpa's math kernel), dropout, the cache's copies and peft's LoRA around a base layer.

Each function takes the replay ``r`` (the step: ``ops.py``'s ops and ``replay.py``'s engine) and does what the
transformers 5.24 (peft 0.21) code does, allocation by allocation; the families compose them into their blocks.
"""

from __future__ import annotations

from ..replay import _T


# --- norms -----------------------------------------------------------------------------------------------------

def rms_norm(r, x: _T, w: _T, label: str, width: int | None = None) -> _T:  # noqa: ANN001 - the replay
    """``LlamaRMSNorm``: in float32, ``weight * (x * rsqrt(mean(x^2) + eps)).to(dtype)`` (the course's too)."""
    rows = x.numel // (width or r.model.d_model)
    h = r.to_float(x, f"{label} x.float()", "activations")
    squared = r.unary(h, "Pow", f"{label} x^2", save_input=True, temps=2)
    variance = r.unary(squared, "Mean", f"{label} mean", numel=rows)
    r.rel(squared)
    shifted = r.add_scalar(variance, f"{label} + eps")
    inv = r.unary(shifted, "Rsqrt", f"{label} rsqrt", save_output=True, temps=2)
    r.rel(shifted)
    normed = r.mul(h, inv, f"{label} x * rsqrt")
    r.rel(inv, h)
    low = r.to_float(normed, f"{label} .to(dtype)", "activations", x.item)
    out = r.mul(w, low, label)
    r.rel(low, normed, variance)
    return out


def gemma_rms_norm(r, x: _T, w: _T, label: str, width: int | None = None) -> _T:  # noqa: ANN001
    """Gemma's RMSNorm: ``_norm(x.float()) * (1.0 + weight.float())``, then ``.type_as(x)``, with
    ``_norm(h) = h * rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)`` one expression (its temporaries go at once)."""
    rows = x.numel // (width or r.model.d_model)
    h = r.to_float(x, f"{label} x.float()", "activations")
    squared = r.unary(h, "Pow", f"{label} x^2", save_input=True, temps=2)
    variance = r.unary(squared, "Mean", f"{label} mean", numel=rows)
    r.rel(squared)
    shifted = r.add_scalar(variance, f"{label} + eps")
    r.rel(variance)
    inv = r.unary(shifted, "Rsqrt", f"{label} rsqrt", save_output=True, temps=2)
    r.rel(shifted)
    normed = r.mul(h, inv, f"{label} x * rsqrt")
    r.rel(inv, h)                                    # _norm returns: its argument x.float() goes
    w32 = r.to_float(w, f"{label} weight.float()", "activations")
    one_plus = r.add_scalar(w32, f"{label} 1 + weight")
    r.rel(w32)
    scaled = r.mul(normed, one_plus, f"{label} * (1 + weight)", numel=normed.numel)
    r.rel(one_plus, normed)
    out = r.to_float(scaled, f"{label} .type_as(x)", "activations", x.item)
    r.rel(scaled)
    return out


# --- the rotary embedding --------------------------------------------------------------------------------------

def rotary(r, label: str = "") -> tuple[_T, _T]:  # noqa: ANN001
    """``LlamaRotaryEmbedding.forward``: cos and sin of ``position_ids.float() * inv_freq``, in x's dtype (the
    position ids are (1, T) in training, (rows, T) inside ``generate``: ``r.position_rows``)."""
    seq, hd = r.setup.seq_len * getattr(r, "position_rows", 1), r.model.head_dim
    half = hd // 2
    item = 2 if r.setup.precision == "bf16" else 4
    pos = r.new(seq, 4, "temporaries", f"{label}position_ids.float()")
    inv = r.new(half, 4, "temporaries", f"{label}inv_freq.float()") if item == 2 else None
    freqs = r.new(seq * half, 4, "temporaries", f"{label}freqs")
    r.rel(pos, inv)
    emb = r.new(seq * hd, 4, "temporaries", f"{label}cat(freqs, freqs)")
    raw = r.new(seq * hd, 4, "temporaries", f"{label}emb.cos()")
    cos = r.new(seq * hd, 4, "activations", f"{label}cos")
    r.rel(raw)
    raw = r.new(seq * hd, 4, "temporaries", f"{label}emb.sin()")
    sin = r.new(seq * hd, 4, "activations", f"{label}sin")
    r.rel(raw)
    cos_out, sin_out = (r.to_float(t, "cos/sin .to(dtype)", "activations", item) for t in (cos, sin))
    r.rel(freqs, emb, cos, sin)                      # the forward's locals, at its return
    return cos_out, sin_out


def rope(r, t: _T, cos: _T, sin: _T, label: str) -> _T:  # noqa: ANN001
    """``(t * cos) + (rotate_half(t) * sin)``, rotate_half(t) = ``cat((-t[..., h:], t[..., :h]), -1)``."""
    first = r.mul(t, cos, f"{label} * cos", numel=t.numel)
    x1 = r.slice_half(t, f"{label}[:h]")
    x2 = r.slice_half(t, f"{label}[h:]")
    minus = r.neg(x2, f"-{label}[h:]")
    rotated = r.cat2(minus, x1, f"rotate_half({label})")
    r.rel(minus, x1, x2)
    second = r.mul(rotated, sin, f"{label} rotated * sin", numel=t.numel)
    r.rel(rotated)
    out = r.add(first, second, f"{label} rotary")
    r.rel(first, second)
    return out


# --- masks -----------------------------------------------------------------------------------------------------

def causal_mask(r, window: int | None, cached: bool) -> _T | None:  # noqa: ANN001
    """``create_causal_mask`` (``window`` None) or ``create_sliding_window_causal_mask``, allocation by allocation:
    None where sdpa can run ``is_causal``, else the (B, 1, T, T) mask (bool for sdpa, 0 / finfo.min in the
    embeddings' dtype for eager), which every layer of its type keeps. Without a cache and without a 2-D mask it
    first looks for packed sequences (``cached``: a ``DynamicCache`` exists)."""
    model, setup = r.model, r.setup
    b, t = setup.micro_batch, setup.seq_len
    slides = window is not None and t >= window
    mask_2d = r.new(b * t, 1, "temporaries", "attention_mask.to(bool)") if setup.padded else None
    if not cached and not setup.padded:              # find_packed_sequence_indices(position_ids)
        first = r.new(b, 8, "temporaries", "position_ids[:, :1] - 1")
        cat = r.new(b * (t + 1), 8, "temporaries", "diff's prepend")
        diff = r.new(b * t, 8, "temporaries", "diff")
        r.rel(cat)
        ne = r.new(b * t, 1, "temporaries", "diff != 1")
        cumsum = r.new(b * t, 8, "temporaries", "cumsum")
        r.rel(ne)
        equal = r.new(b, 1, "temporaries", "packed[:, -1] == 0")
        every = r.new(1, 1, "temporaries", ".all()")
        r.rel(equal, every)
        r.rel(first, diff, cumsum)
    if model.attention == "sdpa" and not slides:
        if not setup.padded:
            r.rel(mask_2d)
            return None
        for _ in range(2):                         # _ignore_causal_mask_sdpa: fast_all, twice
            total = r.new(1, 8, "temporaries", "sum()")
            equal = r.new(1, 1, "temporaries", "== numel")
            r.rel(total, equal)
    aranges = [r.new(b, 8, "temporaries", "arange(B)"), r.new(1, 8, "temporaries", "arange(1)")]
    for name in ("q", "kv"):                      # arange(T) + offset
        raw = r.new(t, 8, "temporaries", f"{name} arange")
        aranges.append(r.new(t, 8, "temporaries", f"{name} arange + offset"))
        r.rel(raw)
    if window is not None:                         # and_masks(sliding_window_overlay, causal) (and padding)
        outer = r.new(1, 1, "temporaries", "new_ones(())") if setup.padded else None
        ones = r.new(1, 1, "temporaries", "new_ones(())")
        shifted = r.new(t, 8, "temporaries", "q_idx - sliding_window")
        inside = r.new(t * t, 1, "temporaries", "kv_idx > q_idx - window")
        r.rel(shifted)
        first = r.new(t * t, 1, "temporaries", "result & window")
        r.rel(inside, ones)
        causal = r.new(t * t, 1, "temporaries", "kv_idx <= q_idx")
        if setup.padded:                           # and_masks(that, padding_mask_function)
            inner = r.new(t * t, 1, "temporaries", "result & causal")
            r.rel(causal, first)
            both = r.new(t * t, 1, "temporaries", "result & sliding causal")
            r.rel(inner, outer)
            picked = r.new(b * t, 1, "temporaries", "padding_mask[b, kv_idx]")
            mask = r.new(b * t * t, 1, "activations", "sliding-window causal mask (bool)")
            r.rel(picked, both)
        else:
            mask = r.new(t * t, 1, "activations", "sliding-window causal mask (bool)")
            r.rel(causal, first)
    elif setup.padded:                             # and_masks(causal, padding)
        ones = r.new(1, 1, "temporaries", "new_ones(())")
        causal = r.new(t * t, 1, "temporaries", "kv_idx <= q_idx")
        both = r.new(t * t, 1, "temporaries", "result & causal")
        r.rel(causal, ones)
        picked = r.new(b * t, 1, "temporaries", "padding_mask[b, kv_idx]")
        mask = r.new(b * t * t, 1, "activations", "causal mask (bool)")
        r.rel(picked, both)
    else:
        mask = r.new(t * t, 1, "activations", "causal mask (bool)")
    r.rel(*aranges)
    if model.attention == "eager":                # torch.where(mask, 0, finfo(dtype).min)
        item = 2 if setup.precision == "bf16" else 4
        zero = r.new(1, item, "temporaries", "zeros(())")
        low = r.new(1, item, "temporaries", "finfo.min")
        floats = r.new(b * t * t, item, "activations", "causal mask (float)")
        r.rel(zero, low, mask)
        mask = floats
    r.rel(mask_2d)
    return mask


def generation_mask(r, window: int | None, rows: int, q_len: int, kv_len: int) -> _T:  # noqa: ANN001
    """``sdpa_mask`` inside ``generate`` (no padding, a cache): the (q, kv) bool mask of ``causal_mask_function``
    (``window`` None) or of ``and_masks(sliding_window_overlay, causal)``, expanded to the rows (a view); the
    aranges go when it returns."""
    aranges = [r.new(rows, 8, "temporaries", "arange(B)"), r.new(1, 8, "temporaries", "arange(1)")]
    for name, length in (("q", q_len), ("kv", kv_len)):                     # arange(length) + offset
        raw = r.new(length, 8, "temporaries", f"{name} arange")
        aranges.append(r.new(length, 8, "temporaries", f"{name} arange + offset"))
        r.rel(raw)
    if window is None:                                                      # kv_idx <= q_idx
        mask = r.new(q_len * kv_len, 1, "activations", "causal mask (bool)")
        r.rel(*aranges)
        return mask
    ones = r.new(1, 1, "temporaries", "new_ones(())")
    shifted = r.new(q_len, 8, "temporaries", "q_idx - sliding_window")
    inside = r.new(q_len * kv_len, 1, "temporaries", "kv_idx > q_idx - window")
    r.rel(shifted)
    first = r.new(q_len * kv_len, 1, "temporaries", "result & window")
    r.rel(inside, ones)
    causal = r.new(q_len * kv_len, 1, "temporaries", "kv_idx <= q_idx")
    mask = r.new(q_len * kv_len, 1, "activations", "sliding-window causal mask (bool)")
    r.rel(causal, first)
    r.rel(*aranges)
    return mask


# --- attention -------------------------------------------------------------------------------------------------

def dropout(r, x: _T, label: str) -> _T:  # noqa: ANN001
    """``nn.Dropout`` in training (p > 0). CUDA: ``native_dropout``, the output and a bool mask, which backward
    keeps. CPU: ``noise = empty_like(x).bernoulli_().div_()``, then ``x * noise`` (keeps noise)."""
    if r.device == "cuda":
        n = r.node(f"NativeDropoutBackward {label}", [(x, "alloc")])
        out = r.new(x.numel, x.item, "activations", label)
        mask = r.new(x.numel, 1, "activations", f"{label} mask")
        r.save(n, mask)
        r.output(out, n)
        r.rel(mask)
        return out
    noise = r.new(x.numel, x.item, "activations", f"{label} noise")
    n = r.node(f"MulBackward {label}", [(x, "alloc")], saved=[noise])
    out = r.output(r.new(x.numel, x.item, "activations", label), n)
    r.rel(noise)
    return out


def maybe_dropout(r, x: _T, p: float, label: str) -> _T:  # noqa: ANN001
    """``nn.Dropout(p)`` in training: x itself (a view) at p == 0."""
    return dropout(r, x, label) if p > 0 else r.view(x)


def sdpa_math(r, q: _T, k: _T, v: _T, mask: _T | None, label: str, k_layout: str,  # noqa: ANN001
              groups: int = 1, q_layout: str = "permuted") -> _T:
    """``F.scaled_dot_product_attention`` with dropout on the CPU: ``_scaled_dot_product_attention_math``.

    A bool mask becomes a float one first (the query's dtype); bf16 inputs are computed in float32 (copies of
    q, k and v, the output and the weights cast back); q and k are each scaled by sqrt(scale); the causal mask
    is ``ones(T, T).tril()`` made float; with ``enable_gqa`` (``groups`` > 1) k and v are then repeated to the
    query's heads (``repeat_interleave``); ``_safe_softmax``; dropout (a noise tensor); ``@ v``. The function's
    locals (the scaled q and k, the float mask, the float32 copies, the repeated k and v) live until it returns."""
    model, setup = r.model, r.setup
    b, t, h = setup.micro_batch, setup.seq_len, model.num_heads
    casts = []
    if r.autocast:
        v, k, q = (r.cast16(x, f"{label} {name} bf16") for x, name in ((v, "value"), (k, "key"), (q, "query")))
        casts = [v, k, q]
    floats = None
    if mask is not None:                                      # convert_boolean_attn_mask, before the kernel
        zero, low = r.new(1, q.item, "temporaries", "0"), r.new(1, q.item, "temporaries", "-inf")
        floats = r.new(b * t * t, q.item, "activations", label + " float mask")   # the mask is expanded to B
        r.rel(zero, low)
    origin = q.item
    outer_autocast, r.autocast = r.autocast, False            # the kernel's own ops run below autocast
    acc = [r.to_float(x, f"{label} {name} .to(float32)", "activations") for x, name in
           ((q, "query"), (k, "key"), (v, "value"))]
    q32, k32, v32 = acc
    q_scaled = r.mul_scalar(q32, label + " query * sqrt(scale)")
    if mask is None:                                          # is_causal: ones(T, T).tril(), made float
        ones = r.new(t * t, 1, "temporaries", label + " ones(T, T)")
        tril = r.new(t * t, 1, "temporaries", label + " .tril()")
        r.rel(ones)
        zero, low = r.new(1, 4, "temporaries", "0"), r.new(1, 4, "temporaries", "-inf")
        floats = r.new(t * t, 4, "activations", label + " float causal mask")
        r.rel(zero, low, tril)
    if groups > 1:                                            # pre_process_group_query_attention_input
        k32, v32 = (r.repeat_interleave(x, groups, f"{label} {name}.repeat_interleave")
                    for x, name in ((k32, "key"), (v32, "value")))
        acc += [k32, v32]
    k_scaled = r.mul_scalar(k32, label + " key^T * sqrt(scale)")
    scores = r.bmm(q_scaled, k_scaled, b * h * t * t, label + " q @ k^T", (q_layout, k_layout), b)
    r.rel(k_scaled)                                           # a temporary of the expression
    # under a TorchDispatchMode (MemTracker, the storage counter) the mask is added out of place; without one,
    # in place (one (B, H, T, T) tensor fewer at that moment)
    masked = r.add(scores, floats, label + " + mask", numel=scores.numel)
    r.rel(scores)
    probs = r.unary(masked, "SafeSoftmax", label + " _safe_softmax", save_output=True)
    r.rel(masked)
    dropped = dropout(r, probs, label + " dropout")
    r.rel(probs)
    # make_tuple(matmul(attn, value).to(origin_dtype), attn.to(origin_dtype)): arguments evaluated right to left
    weights = r.to_float(dropped, label + " weights .to(bf16)", "temporaries", origin)
    out = r.bmm(dropped, v32, q.numel, label + " weights @ v", ("contiguous", k_layout), b)
    if origin != 4:           # the gradient comes back transposed: bmm's backward copies it after the cast
        viewed = r.reshape_copy(out, label + " output", b > 1)
        low_out = r.to_float(viewed, label + " output .to(bf16)", "activations", origin)
        r.rel(out, viewed)
        out = low_out
    r.autocast = outer_autocast
    r.rel(weights, dropped, q_scaled, *acc, floats, *casts)
    mixed = r.contiguous(out, label + " transpose(1, 2).contiguous()", copy_grad=b > 1 and origin == 4)
    r.rel(out)
    return mixed


def copy_cat(r, x: _T, label: str) -> _T:  # noqa: ANN001
    """``torch.cat([empty, x])``: a copy; backward hands x a view of the gradient (``DynamicCache.update``)."""
    n = r.node(f"CatBackward {label}", [(x, "view")])
    return r.output(r.new(x.numel, x.item, "activations", label), n)


# --- peft's LoRA -----------------------------------------------------------------------------------------------

def lora_linear(r, x: _T, prefix: str, path: str, fan_out: int, bias: bool, targets: set[str]) -> _T:  # noqa: ANN001
    """A Linear of a block, or peft's ``lora.Linear``: ``base(x) + lora_B(lora_A(dropout(x))) * scaling``."""
    lora = path in targets
    base_name = prefix + path + (".base_layer" if lora else "")
    w = r.p(base_name + ".weight")
    b = r.p(base_name + ".bias") if bias else None
    flat = x
    if b is not None:      # F.linear on (B, T, C) with a bias: addmm on input.reshape(B·T, C), made before weight.t(),
        flat = r.output(r.view(x), r.node(f"ViewBackward {prefix}{path} flatten", [(x, "pass")]))   # so backward
    result = r.linear(flat, w, b, fan_out, prefix + path)        # hands x its gradient after the weight's is summed
    if flat is not x:
        r.rel(flat)
    if not lora or getattr(r, "adapters_disabled", False):   # peft's disable_adapter(): the base layer alone
        return result
    return peft_lora_add(r, x, result, prefix, path, fan_out)


def peft_lora_add(r, x: _T, result: _T, prefix: str, path: str, fan_out: int) -> _T:  # noqa: ANN001
    """peft's ``LoraLayer.forward`` after the base layer (a Linear, or GPT-2's Conv1D): the input cast to the
    adapters' dtype, dropout, ``lora_B(lora_A(x)) * scaling`` added, cast back."""
    a = r.p(prefix + path + ".lora_A.default.weight")
    b_up = r.p(prefix + path + ".lora_B.default.weight")
    cast = r.to_float(x, f"{prefix}{path} input .to(float32)", "activations", a.item)   # _cast_input_dtype
    dropped = dropout(r, cast, f"{prefix}{path} lora_dropout") if r.setup.lora_dropout else r.view(cast)
    low = r.linear(dropped, a, None, r.setup.lora_rank, prefix + path + ".lora_A")
    r.rel(dropped)
    up = r.linear(low, b_up, None, fan_out, prefix + path + ".lora_B")
    r.rel(low)
    scaled = r.mul_scalar(up, prefix + path + " * scaling")
    r.rel(up)
    total = r.add(result, scaled, prefix + path + " lora sum")
    result_item = result.item
    r.rel(result, scaled)
    if total.item != result_item:                               # result.to(torch_result_dtype)
        back = r.to_float(total, f"{prefix}{path} .to(dtype)", "activations", result_item)
        r.rel(total)
        total = back
    r.rel(cast)
    return total
