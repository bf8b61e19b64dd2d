"""transformers' GPT-2 (``GPT2LMHeadModel``): its parameters as transformers and peft name them, and its step replayed.

What it does that the Llama family does not, each as ``modeling_gpt2`` (transformers 5.24) does it:

* learned positions: ``wpe(arange(T))`` added to ``wte(input_ids)`` (the positions are saved by the embedding's
  backward; both embeddings stay locals of ``GPT2Model.forward`` until it returns);
* ``Conv1D`` projections: ``addmm(bias, x, weight)`` with the weight stored (in, out); ``c_attn`` makes q, k
  and v in one output that ``split`` views (its backward concatenates the three gradients);
* dropout as configured (``embd_pdrop``, ``attn_pdrop``, ``resid_pdrop``; p == 0 is no op at all): on the
  CPU ``x * noise`` keeps its noise tensor; attention dropout sends sdpa to its math kernel (bf16 computed in
  float32, the causal mask made as a float tensor, ``_safe_softmax``, the weights dropped out);
* eager attention (always given a float mask): ``q @ k^T * scale + mask``, a softmax in the scores' dtype,
  ``.type(value.dtype)``, dropout, ``@ v``; the block keeps the weights as a local until it returns;
* ``gelu_new`` written out in eight elementwise ops (it saves four tensors of the MLP's width), or
  ``F.gelu`` for ``gelu_pytorch_tanh`` and ``gelu``;
* LayerNorm with bias, a head tied to ``wte`` (``lm_head`` without bias), the cache's copies of k and v as
  in the Llama family, ``gradient_checkpointing_enable`` (the input embedding made a leaf that its
  ``AccumulateGrad`` keeps until the graph goes);
* peft's LoRA on ``Conv1D`` (``fan_in_fan_out=True``; the adapters are ``nn.Linear`` (r, in) and (out, r));
  peft's default target is ``c_attn``.
"""

from __future__ import annotations

from typing import Callable

from .config import ModelConfig, TrainingSetup
from .replay import _Leaf, _Replay, _T

GPT2_LINEARS = ("attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj")


def gpt2_conv1ds(model: ModelConfig) -> list[tuple[str, int, int]]:
    """A block's ``Conv1D`` layers: (path in the block, in_features, out_features)."""
    d, f = model.d_model, model.ffn
    return [("attn.c_attn", d, 3 * d), ("attn.c_proj", d, d), ("mlp.c_fc", d, f), ("mlp.c_proj", f, d)]


def gpt2_lora_targets(model: ModelConfig, setup: TrainingSetup) -> set[str]:
    """The block paths LoRA adapts (peft's default for GPT-2: ``c_attn``).

    Raises:
        ValueError: a target that names no ``Conv1D`` of the block.
    """
    if not setup.lora_rank:
        return set()
    paths = [path for path, _, _ in gpt2_conv1ds(model)]
    if setup.lora_targets == "all":
        return set(paths)
    if setup.lora_targets == "attention":
        return {"attn.c_attn", "attn.c_proj"}
    chosen = {p for p in paths for t in setup.lora_targets if p == t or p.endswith("." + t)}
    unknown = [t for t in setup.lora_targets if not any(p == t or p.endswith("." + t) for p in paths)]
    if unknown:
        raise ValueError(f"LoRA target(s) {unknown} name no Conv1D layer of a GPT-2 block: expected names among "
                         "['c_attn', 'c_proj', 'c_fc'] (peft's target_modules)")
    return chosen


def gpt2_parameter_shapes(model: ModelConfig, setup: TrainingSetup) -> list[tuple[str, tuple[int, ...], bool]]:
    """Every parameter of ``GPT2LMHeadModel`` (peft-wrapped under LoRA), in ``parameters()`` order.

    ``Conv1D`` keeps its weight as (in, out); the head is tied to ``wte`` (``tie_word_embeddings``).
    """
    lora = setup.lora_rank > 0
    targets = gpt2_lora_targets(model, setup)
    d, v = model.d_model, model.vocab_size
    out: list[tuple[str, tuple[int, ...], bool]] = [("transformer.wte.weight", (v, d), not lora),
                                                    ("transformer.wpe.weight", (model.max_seq_len, d), not lora)]
    for layer in range(model.num_layers):
        prefix = f"transformer.h.{layer}."
        convs = {path: (fan_in, fan_out) for path, fan_in, fan_out in gpt2_conv1ds(model)}

        def conv(path: str) -> None:
            fan_in, fan_out = convs[path]
            base = prefix + path + (".base_layer" if path in targets else "")
            out.extend([(base + ".weight", (fan_in, fan_out), not lora), (base + ".bias", (fan_out,), not lora)])
            if path in targets:
                out.append((prefix + path + ".lora_A.default.weight", (setup.lora_rank, fan_in), True))
                out.append((prefix + path + ".lora_B.default.weight", (fan_out, setup.lora_rank), True))

        out += [(prefix + "ln_1.weight", (d,), not lora), (prefix + "ln_1.bias", (d,), not lora)]
        conv("attn.c_attn")
        conv("attn.c_proj")
        out += [(prefix + "ln_2.weight", (d,), not lora), (prefix + "ln_2.bias", (d,), not lora)]
        conv("mlp.c_fc")
        conv("mlp.c_proj")
    out += [("transformer.ln_f.weight", (d,), not lora), ("transformer.ln_f.bias", (d,), not lora)]
    if not model.tied_embeddings:
        out.append(("lm_head.weight", (v, d), not lora))
    return out


class _HfGpt2:
    """Mixin of ``_Step``: one micro-batch of ``GPT2LMHeadModel`` (peft-wrapped under LoRA), forward and backward."""

    def conv1d(self, x: _T, prefix: str, path: str) -> _T:
        """``Conv1D``: ``addmm(bias, x.view(-1, in), weight)`` (weight (in, out)); under LoRA peft's ``lora.Linear``
        (``fan_in_fan_out=True``): ``base(x) + lora_B(lora_A(dropout(x))) * scaling``."""
        fan_out = {p: o for p, _, o in gpt2_conv1ds(self.model)}[path]
        lora = path in self.gpt2_targets()
        base = prefix + path + (".base_layer" if lora else "")
        w, b = self.p(base + ".weight"), self.p(base + ".bias")
        if self.autocast:                                   # autocast casts addmm's weight, input, then bias
            wc = self.cast16(w, f"{prefix}{path}.weight bf16")
            xc = self.cast16(x, f"{prefix}{path} input bf16")
            bc = self.cast16(b, f"{prefix}{path}.bias bf16")
        else:
            wc, xc, bc = self.view(w), self.view(x), self.view(b)
        casts = [wc, xc, bc]
        saved = ([xc] if wc.rg else []) + ([wc] if xc.rg else [])
        n = self.node(f"AddmmBackward {prefix}{path}", [(bc, "pass"), (xc, "alloc"), (wc, "alloc")], order=[1, 2],
                      saved=saved)
        rows = x.numel // (w.numel // fan_out)
        result = self.output(self.new(rows * fan_out, self.act_item(xc, wc), "activations", prefix + path), n)
        self.rel(*casts)
        if not lora:
            return result
        return self.peft_lora_add(x, result, prefix, path, fan_out)

    def gpt2_targets(self) -> set[str]:
        if not hasattr(self, "_gpt2_targets"):
            self._gpt2_targets = gpt2_lora_targets(self.model, self.setup)
        return self._gpt2_targets

    def gpt2_dropout(self, x: _T, p: float, label: str) -> _T:
        """``nn.Dropout(p)`` in training: x itself at p == 0."""
        return self.dropout(x, label) if p > 0 else self.view(x)

    def gelu_new(self, x: _T, label: str) -> _T:
        """``NewGELUActivation``: ``0.5 * x * (1.0 + tanh(sqrt(2 / pi) * (x + 0.044715 * pow(x, 3.0))))``, op by op:
        it keeps x (pow's), the tanh, ``0.5 * x`` and ``1 + tanh`` for backward."""
        half = self.mul_scalar(x, label + " 0.5 * x")
        cube = self.unary(x, "Pow", label + " pow(x, 3)", save_input=True, temps=2)
        scaled = self.mul_scalar(cube, label + " 0.044715 * x^3")
        self.rel(cube)
        inner = self.add(x, scaled, label + " x + 0.044715 x^3")
        self.rel(scaled)
        arg = self.mul_scalar(inner, label + " * sqrt(2 / pi)")
        self.rel(inner)
        th = self.unary(arg, "Tanh", label + " tanh", save_output=True)
        self.rel(arg)
        one_plus = self.add_scalar(th, label + " 1 + tanh")
        self.rel(th)
        out = self.mul(half, one_plus, label)
        self.rel(half, one_plus)
        return out

    def gpt2_activation(self, x: _T, label: str) -> _T:
        if (self.model.activation or "gelu_new") == "gelu_new":
            return self.gelu_new(x, label)
        return self.gelu(x, label)                                  # F.gelu (approximate "tanh" or "none")

    def gpt2_attention(self, q: _T, k: _T, v: _T, mask: _T | None, label: str, cached: bool) -> _T:
        """``sdpa_attention_forward`` or GPT-2's ``eager_attention_forward``: (B, H, T, hd) in, (B, T, d) out."""
        model, setup = self.model, self.setup
        b, t, h = setup.micro_batch, setup.seq_len, model.num_heads
        p = model.dropout[1]
        # the flash kernel; with attention dropout on CUDA too (it drops out inside; not measured on a GPU yet)
        if model.attention == "sdpa" and (not p or self.device == "cuda"):
            return self.sdpa(q, k, v, b * h * t, label, b * t * t if mask is not None else None)
        k_layout = "contiguous" if cached else "permuted"         # the cache's copies, or views of c_attn's output
        if model.attention == "sdpa":                             # dropout: sdpa's math kernel, op by op
            return self.sdpa_math(q, k, v, mask, label, k_layout)
        scores = self.bmm(q, k, b * h * t * t, label + " q @ k^T", ("permuted", k_layout), b)     # eager
        scaled = self.mul_scalar(scores, label + " * scaling")
        self.rel(scores)
        masked = self.add(scaled, mask, label + " + mask", numel=scaled.numel)
        self.rel(scaled)
        probs = self.unary(masked, "Softmax", label + " softmax", save_output=True)
        self.rel(masked)
        low = self.to_float(probs, label + " .type(value.dtype)", "activations", v.item)
        self.rel(probs)
        dropped = self.dropout(low, label + " attn_dropout") if p else self.view(low)
        self.rel(low)
        out = self.bmm(dropped, v, q.numel, label + " weights @ v", ("contiguous", k_layout), b)
        self.attention_weights = dropped                          # returned: `attn_output, _ = self.attn(...)`
        mixed = self.contiguous(out, label + " .reshape(B, T, d)", copy_grad=b > 1)
        self.rel(out)
        return mixed

    def sdpa_math(self, q: _T, k: _T, v: _T, mask: _T | None, label: str, k_layout: str) -> _T:
        """``F.scaled_dot_product_attention`` with dropout on the CPU: ``_scaled_dot_product_attention_math``.

        A bool mask becomes a float one first (the query's dtype); bf16 inputs are computed in float32 (copies of
        q, k and v, the output and the weights cast back); q and k are each scaled by sqrt(scale); the causal mask
        is ``ones(T, T).tril()`` made float; ``_safe_softmax``; dropout (a noise tensor); ``@ v``. The function's
        locals (the scaled q and k, the float mask, the float32 copies) live until it returns."""
        model, setup = self.model, self.setup
        b, t, h = setup.micro_batch, setup.seq_len, model.num_heads
        casts = []
        if self.autocast:
            v, k, q = (self.cast16(x, f"{label} {name} bf16") for x, name in ((v, "value"), (k, "key"), (q, "query")))
            casts = [v, k, q]
        floats = None
        if mask is not None:                                      # convert_boolean_attn_mask, before the kernel
            zero, low = self.new(1, q.item, "temporaries", "0"), self.new(1, q.item, "temporaries", "-inf")
            floats = self.new(b * t * t, q.item, "activations", label + " float mask")
            self.rel(zero, low)
        origin = q.item
        outer_autocast, self.autocast = self.autocast, False      # the kernel's own ops run below autocast
        acc = [self.to_float(x, f"{label} {name} .to(float32)", "activations") for x, name in
               ((q, "query"), (k, "key"), (v, "value"))]
        q32, k32, v32 = acc
        q_scaled = self.mul_scalar(q32, label + " query * sqrt(scale)")
        if mask is None:                                          # is_causal: ones(T, T).tril(), made float
            ones = self.new(t * t, 1, "temporaries", label + " ones(T, T)")
            tril = self.new(t * t, 1, "temporaries", label + " .tril()")
            self.rel(ones)
            zero, low = self.new(1, 4, "temporaries", "0"), self.new(1, 4, "temporaries", "-inf")
            floats = self.new(t * t, 4, "activations", label + " float causal mask")
            self.rel(zero, low, tril)
        k_scaled = self.mul_scalar(k32, label + " key^T * sqrt(scale)")
        scores = self.bmm(q_scaled, k_scaled, b * h * t * t, label + " q @ k^T", ("permuted", k_layout), b)
        self.rel(k_scaled)                                        # a temporary of the expression
        # under a TorchDispatchMode (MemTracker, the storage counter) the mask is added out of place; without one,
        # in place (one (B, H, T, T) tensor fewer at that moment)
        masked = self.add(scores, floats, label + " + mask", numel=scores.numel)
        self.rel(scores)
        probs = self.unary(masked, "SafeSoftmax", label + " _safe_softmax", save_output=True)
        self.rel(masked)
        dropped = self.dropout(probs, label + " dropout")
        self.rel(probs)
        # make_tuple(matmul(attn, value).to(origin_dtype), attn.to(origin_dtype)): arguments evaluated right to left
        weights = self.to_float(dropped, label + " weights .to(bf16)", "temporaries", origin)
        out = self.bmm(dropped, v32, q.numel, label + " weights @ v", ("contiguous", k_layout), b)
        if origin != 4:           # the gradient comes back transposed: bmm's backward copies it after the cast
            viewed = self.reshape_copy(out, label + " output", b > 1)
            low_out = self.to_float(viewed, label + " output .to(bf16)", "activations", origin)
            self.rel(out, viewed)
            out = low_out
        self.autocast = outer_autocast
        self.rel(weights, dropped, q_scaled, *acc, floats, *casts)
        mixed = self.contiguous(out, label + " transpose(1, 2).contiguous()", copy_grad=b > 1 and origin == 4)
        self.rel(out)
        return mixed

    def gpt2_block(self, layer: int, mask: _T | None, cache: list[_T] | None) -> Callable[[_Replay, _T], _T]:
        """``GPT2Block.forward`` for one layer."""
        prefix = f"transformer.h.{layer}."
        model = self.model
        resid_p = model.dropout[2]

        def block(r: _Replay, x: _T) -> _T:
            n1 = self.layer_norm(x, self.p(prefix + "ln_1.weight"), self.p(prefix + "ln_1.bias"), model.d_model,
                                 prefix + "ln_1")
            qkv = self.conv1d(n1, prefix, "attn.c_attn")
            q, k, v = self.split3(qkv, prefix + "attn split")
            self.rel(qkv)
            # .view(B, T, H, hd).transpose(1, 2): reshaping a gradient back copies it unless it arrives in the
            # transposed layout: the flash kernel's do; those of a matmul do not, except the key's (it entered
            # transposed)
            if model.attention == "eager" or model.dropout[1]:
                q_view, v_view = q, v
                q = self.reshape_copy(q_view, prefix + "query", model.num_heads > 1)
                v = self.reshape_copy(v_view, prefix + "value", model.num_heads > 1)
                self.rel(q_view, v_view)
            if cache is not None:                            # DynamicCache.update: torch.cat([empty, states])
                k_cached = self.copy_cat(k, prefix + "cache keys")
                v_cached = self.copy_cat(v, prefix + "cache values")
                self.rel(k, v)
                k, v = k_cached, v_cached
                cache.extend([self.view(k_cached), self.view(v_cached)])
            self.attention_weights = None
            attended = self.gpt2_attention(q, k, v, mask, prefix + "attention", cache is not None)
            weights = self.attention_weights                 # eager's: a local of the block ("_")
            proj = self.conv1d(attended, prefix, "attn.c_proj")
            self.rel(attended)
            attn = self.gpt2_dropout(proj, resid_p, prefix + "attn.resid_dropout")
            self.rel(proj, q, k, v)                          # GPT2Attention.forward returns
            x1 = self.add(attn, x, prefix + "residual 1")   # attn_output stays a local of the block
            self.rel(n1)
            n2 = self.layer_norm(x1, self.p(prefix + "ln_2.weight"), self.p(prefix + "ln_2.bias"), model.d_model,
                                 prefix + "ln_2")
            fc = self.conv1d(n2, prefix, "mlp.c_fc")
            act = self.gpt2_activation(fc, prefix + "mlp.act")
            self.rel(fc)
            down = self.conv1d(act, prefix, "mlp.c_proj")
            self.rel(act)
            ff = self.gpt2_dropout(down, resid_p, prefix + "mlp.dropout")
            self.rel(down)                                   # GPT2MLP.forward returns
            x2 = self.add(x1, ff, prefix + "residual 2")
            self.rel(n2, attn, x1, ff, weights)              # the block returns: its locals go
            return x2

        return block

    def gpt2_micro_batch(self, micro: int) -> None:
        """``loss = model(input_ids, attention_mask=..., labels=...).loss`` (or your own loss on the logits) for
        ``GPT2LMHeadModel``, then its backward."""
        model, setup = self.model, self.setup
        d, n_tok = model.d_model, setup.tokens
        ckpt = setup.checkpointing != "none"
        tok = self.embedding(self.p("transformer.wte.weight"), n_tok * d, "wte")
        embeds_leaf = None
        if ckpt and not tok.rg:                            # enable_input_require_grads: the output becomes a leaf
            embeds_leaf = _Leaf("inputs_embeds", (n_tok * d,), tok.item, True)
            embeds_leaf.tensor = tok
            tok.rg, tok.leaf = True, embeds_leaf
            self.incref(tok.buf)                           # its AccumulateGrad keeps it until the graph goes
        cache: list[_T] | None = [] if model.use_cache and not ckpt else None
        arange = self.new(setup.seq_len, 8, "temporaries", "arange(T)")
        position_ids = self.new(setup.seq_len, 8, "activations", "position_ids")
        self.rel(arange)
        pos = self.embedding(self.p("transformer.wpe.weight"), setup.seq_len * d, "wpe", position_ids)
        x = self.add(tok, pos, "inputs_embeds + position_embeds", numel=n_tok * d)
        mask = self.hf_mask()
        dropped = self.gpt2_dropout(x, model.dropout[0], "transformer.drop")
        self.rel(x)
        x = dropped
        for layer in range(model.num_layers):
            self.set_phase(f"m{micro}.f{layer}")
            fn = self.gpt2_block(layer, mask, cache)
            extra = [position_ids] + ([mask] if mask is not None else [])   # the layer's arguments
            out = self.checkpointed(fn, x, *extra) if ckpt else fn(self, x)
            self.rel(x)
            x = out
            if x.node is not None:
                x.node.phase = f"m{micro}.b{layer}"
        self.set_phase(f"m{micro}.head")
        final = self.layer_norm(x, self.p("transformer.ln_f.weight"), self.p("transformer.ln_f.bias"), d,
                                "transformer.ln_f")
        self.rel(x)
        self.rel(tok, pos, position_ids, mask)            # GPT2Model.forward returns: its locals go
        w = self.p("transformer.wte.weight" if model.tied_embeddings else "lm_head.weight")
        logits = self.linear(final, w, None, model.vocab_size, "logits")
        loss = self.hf_loss(logits, [final, *(cache or [])])
        self.set_phase(f"m{micro}.exit")
        if self.autocast:
            self.autocast_exit()
        self.hf_backward(micro, loss)
        if embeds_leaf is not None:                        # the graph is gone: so are the leaf and its .grad
            if embeds_leaf.grad is not None:
                self.decref(embeds_leaf.grad)
            embeds_leaf.grad = None
            self.decref(tok.buf)
