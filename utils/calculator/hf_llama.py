"""transformers' Llama family (``LlamaForCausalLM``, Mistral, Qwen2), replayed as transformers 5 trains it.

What differs from the course's ``llama_like`` (``llama.py``), each a thing ``modeling_llama`` does:

* ``position_ids`` (``arange(T) + past_seen_tokens``) live for the whole forward; the rotary embedding
  computes ``position_ids.float() * inv_freq`` (two buffers, ``inv_freq`` and ``original_inv_freq``);
* in training mode without checkpointing ``use_cache`` stays on: a ``DynamicCache`` keeps a copy
  (``torch.cat``) of every layer's keys and values until the model's output is dropped, and attention
  runs on those copies;
* the mask: sdpa without padding passes ``is_causal`` and no mask; with padding (or eager attention,
  or a sequence as long as Mistral's sliding window) the 4-D mask is built once and every layer's
  attention keeps it; sdpa with grouped-query attention and no mask passes ``enable_gqa`` instead of
  repeating the key/value heads;
* eager attention: ``q @ k^T * scale + mask``, a float32 softmax, ``@ v``, each saved as PyTorch saves it;
* ``labels=``: ``logits.float()``, labels padded by one and shifted (a contiguous copy that
  ``nll_loss`` keeps), the mean over tokens that are not -100; the output object keeps the logits
  (and the cache) until the reader drops it: ``loss = model(...).loss`` drops it at once;
* ``activation_checkpointing_enable()`` (``gradient_checkpointing_enable``, non-reentrant) checkpoints
  each decoder layer, turns the cache off, and makes the embedding's output require grad;
* peft's LoRA (``lora_A``, ``lora_B`` as ``nn.Linear``, ``lora_dropout`` an ``nn.Identity`` at 0): the
  adapters stay float32 on a bf16 model (peft's ``autocast_adapter_dtype``), so peft casts their input
  to float32 and the sum back to the base layer's dtype.
"""

from __future__ import annotations

from typing import Callable

from .config import ModelConfig, TrainingSetup
from .replay import _Leaf, _Replay, _T

ATTENTION_PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP_PROJECTIONS = ("gate_proj", "up_proj", "down_proj")


def hf_linears(model: ModelConfig) -> list[tuple[str, int, int, bool]]:
    """A decoder layer's Linear layers: (path in the layer, in_features, out_features, bias)."""
    d, f, hd = model.d_model, model.ffn, model.head_dim
    q, kv = model.num_heads * hd, model.kv_heads * hd
    return [("self_attn.q_proj", d, q, model.qkv_bias), ("self_attn.k_proj", d, kv, model.qkv_bias),
            ("self_attn.v_proj", d, kv, model.qkv_bias), ("self_attn.o_proj", q, d, model.out_bias),
            ("mlp.gate_proj", d, f, model.mlp_bias), ("mlp.up_proj", d, f, model.mlp_bias),
            ("mlp.down_proj", f, d, model.mlp_bias)]


def hf_lora_targets(model: ModelConfig, setup: TrainingSetup) -> set[str]:
    """The short names (``q_proj``, ...) of the Linear layers LoRA adapts (empty without LoRA).

    Raises:
        ValueError: a target that names no Linear layer of the model's blocks.
    """
    if not setup.lora_rank:
        return set()
    names = [path.rsplit(".", 1)[1] for path, _, _, _ in hf_linears(model)]
    if setup.lora_targets == "all":
        return set(names)
    if setup.lora_targets == "attention":
        return set(ATTENTION_PROJECTIONS)
    unknown = [t for t in setup.lora_targets if t.rsplit(".", 1)[-1] not in names]
    if unknown:
        raise ValueError(f"LoRA target(s) {unknown} name no Linear layer of a {model.name} block: expected names "
                         f"among {names} (peft's target_modules; 'all-linear' for every one of them)")
    return {t.rsplit(".", 1)[-1] for t in setup.lora_targets}


def hf_leaf_item(name: str, setup: TrainingSetup) -> int:
    """Bytes per element of a parameter: peft's adapters stay float32 on a bf16 model."""
    if ".lora_A." in name or ".lora_B." in name:
        return 4
    return 2 if setup.precision == "bf16" else 4


def hf_parameter_shapes(model: ModelConfig, setup: TrainingSetup) -> list[tuple[str, tuple[int, ...], bool]]:
    """Every parameter of the transformers model (peft-wrapped when LoRA is on), in ``parameters()`` order."""
    if model.arch == "hf-gpt2":
        from .hf_gpt2 import gpt2_parameter_shapes

        return gpt2_parameter_shapes(model, setup)
    lora = setup.lora_rank > 0
    targets = hf_lora_targets(model, setup)
    d, v = model.d_model, model.vocab_size
    out: list[tuple[str, tuple[int, ...], bool]] = [("model.embed_tokens.weight", (v, d), not lora)]
    for layer in range(model.num_layers):
        prefix = f"model.layers.{layer}."
        for path, fan_in, fan_out, bias in hf_linears(model):
            short = path.rsplit(".", 1)[1]
            base = prefix + path + (".base_layer" if short in targets else "")
            out.append((base + ".weight", (fan_out, fan_in), not lora))
            if bias:
                out.append((base + ".bias", (fan_out,), not lora))
            if short in targets:                    # peft registers lora_A and lora_B after the base layer
                out.append((prefix + path + ".lora_A.default.weight", (setup.lora_rank, fan_in), True))
                out.append((prefix + path + ".lora_B.default.weight", (fan_out, setup.lora_rank), True))
        out += [(prefix + "input_layernorm.weight", (d,), not lora),
                (prefix + "post_attention_layernorm.weight", (d,), not lora)]
    out.append(("model.norm.weight", (d,), not lora))
    if not model.tied_embeddings:
        out.append(("lm_head.weight", (v, d), not lora))
    return out


class _HfLlama:
    """Mixin of ``_Step``: one micro-batch of a transformers Llama-family model, forward and backward."""

    # -- what lives with the model
    def hf_buffers(self) -> None:
        """The model's buffers: the rotary embedding's ``inv_freq`` and ``original_inv_freq`` (GPT-2: none)."""
        if self.model.arch == "hf-gpt2":
            return
        item = 2 if self.setup.precision == "bf16" else 4
        for name in ("inv_freq", "original_inv_freq"):
            self.incref(self._alloc(self.model.head_dim // 2 * item, "parameters", f"rotary_emb.{name}"))

    def hf_targets(self) -> set[str]:
        if not hasattr(self, "_hf_targets"):
            self._hf_targets = hf_lora_targets(self.model, self.setup)
        return self._hf_targets

    # -- ops of the Hugging Face code
    def copy_cat(self, x: _T, label: str) -> _T:
        """``torch.cat([empty, x])``: a copy; backward hands x a view of the gradient (``DynamicCache.update``)."""
        n = self.node(f"CatBackward {label}", [(x, "view")])
        return self.output(self.new(x.numel, x.item, "activations", label), n)

    def dropout(self, x: _T, label: str) -> _T:
        """``nn.Dropout`` in training (p > 0). CUDA: ``native_dropout``, the output and a bool mask, which
        backward keeps. CPU: ``noise = empty_like(x).bernoulli_().div_()``, then ``x * noise`` (keeps noise)."""
        if self.device == "cuda":
            n = self.node(f"NativeDropoutBackward {label}", [(x, "alloc")])
            out = self.new(x.numel, x.item, "activations", label)
            mask = self.new(x.numel, 1, "activations", f"{label} mask")
            self.save(n, mask)
            self.output(out, n)
            self.rel(mask)
            return out
        noise = self.new(x.numel, x.item, "activations", f"{label} noise")
        n = self.node(f"MulBackward {label}", [(x, "alloc")], saved=[noise])
        out = self.output(self.new(x.numel, x.item, "activations", label), n)
        self.rel(noise)
        return out

    def hf_lin(self, x: _T, prefix: str, path: str) -> _T:
        """A Linear of a block, or peft's ``lora.Linear``: ``base(x) + lora_B(lora_A(dropout(x))) * scaling``."""
        fan_out, bias = {p: (o, b) for p, _, o, b in hf_linears(self.model)}[path]
        short = path.rsplit(".", 1)[1]
        lora = short in self.hf_targets()
        base_name = prefix + path + (".base_layer" if lora else "")
        w = self.p(base_name + ".weight")
        b = self.p(base_name + ".bias") if bias else None
        result = self.linear(x, w, b, fan_out, prefix + path)
        if not lora:
            return result
        return self.peft_lora_add(x, result, prefix, path, fan_out)

    def peft_lora_add(self, x: _T, result: _T, prefix: str, path: str, fan_out: int) -> _T:
        """peft's ``LoraLayer.forward`` after the base layer (a Linear here, GPT-2's Conv1D in ``hf_gpt2.py``): the
        input cast to the adapters' dtype, dropout, ``lora_B(lora_A(x)) * scaling`` added, cast back."""
        a = self.p(prefix + path + ".lora_A.default.weight")
        b_up = self.p(prefix + path + ".lora_B.default.weight")
        cast = self.to_float(x, f"{prefix}{path} input .to(float32)", "activations", a.item)   # _cast_input_dtype
        dropped = self.dropout(cast, f"{prefix}{path} lora_dropout") if self.setup.lora_dropout else self.view(cast)
        low = self.linear(dropped, a, None, self.setup.lora_rank, prefix + path + ".lora_A")
        self.rel(dropped)
        up = self.linear(low, b_up, None, fan_out, prefix + path + ".lora_B")
        self.rel(low)
        scaled = self.mul_scalar(up, prefix + path + " * scaling")
        self.rel(up)
        total = self.add(result, scaled, prefix + path + " lora sum")
        result_item = result.item
        self.rel(result, scaled)
        if total.item != result_item:                               # result.to(torch_result_dtype)
            back = self.to_float(total, f"{prefix}{path} .to(dtype)", "activations", result_item)
            self.rel(total)
            total = back
        self.rel(cast)
        return total

    def hf_rotary(self) -> tuple[_T, _T]:
        """``LlamaRotaryEmbedding.forward``: cos and sin of ``position_ids.float() * inv_freq``, in x's dtype."""
        seq, hd = self.setup.seq_len, self.model.head_dim
        half = hd // 2
        item = 2 if self.setup.precision == "bf16" else 4
        pos = self.new(seq, 4, "temporaries", "position_ids.float()")
        inv = self.new(half, 4, "temporaries", "inv_freq.float()") if item == 2 else None
        freqs = self.new(seq * half, 4, "temporaries", "freqs")
        self.rel(pos, inv)
        emb = self.new(seq * hd, 4, "temporaries", "cat(freqs, freqs)")
        raw = self.new(seq * hd, 4, "temporaries", "emb.cos()")
        cos = self.new(seq * hd, 4, "activations", "cos")
        self.rel(raw)
        raw = self.new(seq * hd, 4, "temporaries", "emb.sin()")
        sin = self.new(seq * hd, 4, "activations", "sin")
        self.rel(raw)
        cos_out, sin_out = (self.to_float(t, "cos/sin .to(dtype)", "activations", item) for t in (cos, sin))
        self.rel(freqs, emb, cos, sin)                      # the forward's locals, at its return
        return cos_out, sin_out

    def hf_mask(self) -> _T | None:
        """``create_causal_mask``, allocation by allocation: None where sdpa can run ``is_causal``, else the
        (B, 1, T, T) mask (bool for sdpa, 0 / finfo.min in the embeddings' dtype for eager), which every layer's
        attention keeps. Without a cache and without a 2-D mask it first looks for packed sequences."""
        model, setup = self.model, self.setup
        b, t = setup.micro_batch, setup.seq_len
        no_cache = not model.use_cache or setup.checkpointing != "none"
        window = model.sliding_window is not None and t >= model.sliding_window
        mask_2d = self.new(b * t, 1, "temporaries", "attention_mask.to(bool)") if setup.padded else None
        if no_cache and not setup.padded:             # find_packed_sequence_indices(position_ids)
            first = self.new(b, 8, "temporaries", "position_ids[:, :1] - 1")
            cat = self.new(b * (t + 1), 8, "temporaries", "diff's prepend")
            diff = self.new(b * t, 8, "temporaries", "diff")
            self.rel(cat)
            ne = self.new(b * t, 1, "temporaries", "diff != 1")
            cumsum = self.new(b * t, 8, "temporaries", "cumsum")
            self.rel(ne)
            equal = self.new(b, 1, "temporaries", "packed[:, -1] == 0")
            every = self.new(1, 1, "temporaries", ".all()")
            self.rel(equal, every)
            self.rel(first, diff, cumsum)
        if model.attention == "sdpa" and not window:
            if not setup.padded:
                return None
            for _ in range(2):                         # _ignore_causal_mask_sdpa: fast_all, twice
                total = self.new(1, 8, "temporaries", "sum()")
                equal = self.new(1, 1, "temporaries", "== numel")
                self.rel(total, equal)
        aranges = [self.new(b, 8, "temporaries", "arange(B)"), self.new(1, 8, "temporaries", "arange(1)")]
        for name in ("q", "kv"):                      # arange(T) + offset
            raw = self.new(t, 8, "temporaries", f"{name} arange")
            aranges.append(self.new(t, 8, "temporaries", f"{name} arange + offset"))
            self.rel(raw)
        if window and not setup.padded:                # and_masks(sliding_window_overlay, causal)
            ones = self.new(1, 1, "temporaries", "new_ones(())")
            shifted = self.new(t, 8, "temporaries", "q_idx - sliding_window")
            inside = self.new(t * t, 1, "temporaries", "kv_idx > q_idx - window")
            self.rel(shifted)
            first = self.new(t * t, 1, "temporaries", "result & window")
            self.rel(inside, ones)
            causal = self.new(t * t, 1, "temporaries", "kv_idx <= q_idx")
            mask = self.new(t * t, 1, "activations", "sliding-window causal mask (bool)")
            self.rel(causal, first)
        elif setup.padded:                             # and_masks(causal, padding)
            ones = self.new(1, 1, "temporaries", "new_ones(())")
            causal = self.new(t * t, 1, "temporaries", "kv_idx <= q_idx")
            both = self.new(t * t, 1, "temporaries", "result & causal")
            self.rel(causal, ones)
            picked = self.new(b * t, 1, "temporaries", "padding_mask[b, kv_idx]")
            mask = self.new(b * t * t, 1, "activations", "causal mask (bool)")
            self.rel(picked, both)
        else:
            mask = self.new(t * t, 1, "activations", "causal mask (bool)")
        self.rel(*aranges)
        if model.attention == "eager":                # torch.where(mask, 0, finfo(dtype).min)
            item = 2 if setup.precision == "bf16" else 4
            zero = self.new(1, item, "temporaries", "zeros(())")
            low = self.new(1, item, "temporaries", "finfo.min")
            floats = self.new(b * t * t, item, "activations", "causal mask (float)")
            self.rel(zero, low, mask)
            mask = floats
        self.rel(mask_2d)
        return mask

    def hf_attention(self, q: _T, k: _T, v: _T, mask: _T | None, label: str, cached: bool) -> _T:
        """``sdpa_attention_forward`` or ``eager_attention_forward``: (B, H, T, hd) in, (B, T, H * hd) out.

        ``cached``: k and v are the cache's contiguous copies (else k has the rotary output's transposed layout
        and v is a transposed view of the projection)."""
        model, setup = self.model, self.setup
        groups = model.num_heads // model.kv_heads
        b, t, h = setup.micro_batch, setup.seq_len, model.num_heads
        if model.attention == "sdpa":
            gqa = groups > 1 and mask is None and model.head_dim <= 256
            if groups > 1 and not gqa:
                k, v = self.repeat_kv(k, groups, label + " repeat_kv(key)"), self.repeat_kv(v, groups, label + " repeat_kv(value)")
            else:
                k, v = self.view(k), self.view(v)
            # a bool mask becomes a float one inside sdpa, per layer: where(mask, 0, -inf) in the query's dtype
            out = self.sdpa(q, k, v, b * h * t, label, b * t * t if mask is not None else None)
            self.rel(k, v)
            return out
        source = "contiguous" if cached else "permuted"
        k_layout = source if groups == 1 else ("expanded" if model.kv_heads == 1 else "contiguous")
        v_layout = source if groups == 1 else ("expanded" if model.kv_heads == 1 else "contiguous")
        k_rep = self.repeat_kv(k, groups, label + " repeat_kv(key)")
        v_rep = self.repeat_kv(v, groups, label + " repeat_kv(value)")
        scores = self.bmm(q, k_rep, b * h * t * t, label + " q @ k^T", ("permuted", k_layout), b)
        scaled = self.mul_scalar(scores, label + " * scaling")
        self.rel(scores)
        masked = self.add(scaled, mask, label + " + mask", numel=scaled.numel)
        self.rel(scaled)
        probs = self.softmax(masked, label + " softmax")
        self.rel(masked)
        low = self.to_float(probs, label + " .to(query.dtype)", "activations", q.item)
        self.rel(probs)
        mixed = self.bmm(low, v_rep, q.numel, label + " weights @ v", ("contiguous", v_layout), b)
        self.rel(k_rep, v_rep)
        out = self.contiguous(mixed, label + " transpose(1, 2).contiguous()", copy_grad=b > 1)
        self.rel(mixed, low)
        return out

    def hf_block(self, layer: int, cos: _T, sin: _T, mask: _T | None, cache: list[_T] | None
                 ) -> Callable[[_Replay, _T], _T]:
        """``LlamaDecoderLayer.forward`` for one layer."""
        prefix = f"model.layers.{layer}."
        model = self.model
        groups = model.num_heads // model.kv_heads

        def block(r: _Replay, x: _T) -> _T:
            n1 = self.rms_norm(x, self.p(prefix + "input_layernorm.weight"), prefix + "input_layernorm")
            views = []
            # reshaping a gradient back through .view().transpose(1, 2) copies it unless it arrives in the
            # transposed layout: sdpa's own gradients do (the CPU and CUDA kernels work in (B, T, H, hd)); those
            # of the rotary embedding, of repeat_kv's sum and of eager attention's bmm do not
            repeated_v = model.attention == "eager" or (groups > 1 and mask is not None)
            for path, copy_grad in (("self_attn.q_proj", model.num_heads > 1), ("self_attn.k_proj", model.kv_heads > 1),
                                    ("self_attn.v_proj", repeated_v and model.kv_heads > 1)):
                out = self.hf_lin(n1, prefix, path)          # .view(B, T, heads, hd).transpose(1, 2)
                views.append(self.reshape_copy(out, prefix + path, copy_grad))
                self.rel(out)
            q, k, v = views
            q_rot = self.rope(q, cos, sin, prefix + "query")
            k_rot = self.rope(k, cos, sin, prefix + "key")
            self.rel(q, k)
            if cache is not None:                            # DynamicCache.update: torch.cat([empty, states])
                k_cached = self.copy_cat(k_rot, prefix + "cache keys")
                v_cached = self.copy_cat(v, prefix + "cache values")
                self.rel(k_rot, v)
                k_rot, v = k_cached, v_cached
                cache.extend([self.view(k_cached), self.view(v_cached)])
            attended = self.hf_attention(q_rot, k_rot, v, mask, prefix + "attention", cache is not None)
            attn = self.hf_lin(attended, prefix, "self_attn.o_proj")
            self.rel(attended, q_rot, k_rot, v, n1)          # LlamaAttention.forward's locals, then the layer's
            x1 = self.add(x, attn, prefix + "residual 1")
            self.rel(attn)
            n2 = self.rms_norm(x1, self.p(prefix + "post_attention_layernorm.weight"),
                               prefix + "post_attention_layernorm")
            gate = self.hf_lin(n2, prefix, "mlp.gate_proj")
            act = self.unary(gate, "Silu", prefix + "silu", save_input=True)
            self.rel(gate)
            up = self.hf_lin(n2, prefix, "mlp.up_proj")
            product = self.mul(act, up, prefix + "silu * up")
            self.rel(act, up)
            down = self.hf_lin(product, prefix, "mlp.down_proj")
            self.rel(product, n2)
            x2 = self.add(x1, down, prefix + "residual 2")
            self.rel(down, x1)
            return x2

        return block

    # -- one micro-batch
    def hf_micro_batch(self, micro: int) -> None:
        """``loss = model(input_ids, attention_mask=..., labels=...).loss`` (or your own loss on the logits),
        then ``(loss / accumulation_steps).backward()``."""
        if self.model.arch == "hf-gpt2":
            self.gpt2_micro_batch(micro)
            return
        model, setup = self.model, self.setup
        d, n_tok = model.d_model, setup.tokens
        ckpt = setup.checkpointing != "none"
        x = self.embedding(self.p("model.embed_tokens.weight"), n_tok * d, "token embedding")
        inputs_embeds = self.view(x)                        # LlamaModel.forward's local, alive until it returns
        embeds_leaf = None
        if ckpt and not x.rg:                             # enable_input_require_grads: the output becomes a leaf
            embeds_leaf = _Leaf("inputs_embeds", (n_tok * d,), x.item, True)
            embeds_leaf.tensor = x
            x.rg, x.leaf = True, embeds_leaf
        cache: list[_T] | None = [] if model.use_cache and not ckpt else None
        if cache is not None and model.sliding_window is not None:   # DynamicCache's sliding layers: two scalars
            cache += [self.new(1, 8, "activations", "cache scalar"), self.new(1, 8, "activations", "cache scalar")]
        arange = self.new(setup.seq_len, 8, "temporaries", "arange(T)")
        position_ids = self.new(setup.seq_len, 8, "activations", "position_ids")
        self.rel(arange)
        mask = self.hf_mask()
        cos, sin = self.hf_rotary()
        for layer in range(model.num_layers):
            self.set_phase(f"m{micro}.f{layer}")
            fn = self.hf_block(layer, cos, sin, mask, cache)
            extra = [cos, sin, position_ids] + ([mask] if mask is not None else [])   # the layer's kwargs
            out = self.checkpointed(fn, x, *extra) if ckpt else fn(self, x)
            self.rel(x)
            x = out
            if x.node is not None:
                x.node.phase = f"m{micro}.b{layer}"
        self.set_phase(f"m{micro}.head")
        final = self.rms_norm(x, self.p("model.norm.weight"), "model.norm")
        self.rel(x)
        self.rel(position_ids, inputs_embeds, mask, cos, sin)   # LlamaModel.forward returns: its locals go
        w = self.p("model.embed_tokens.weight" if model.tied_embeddings else "lm_head.weight")
        logits = self.linear(final, w, None, model.vocab_size, "logits")
        # the forward returns; the output objects die (the model's: its last hidden state and cache; the causal LM's:
        # its logits) where the loss says
        loss = self.hf_loss(logits, [final, *(cache or [])])
        self.set_phase(f"m{micro}.exit")
        if self.autocast:
            self.autocast_exit()
        self.hf_backward(micro, loss)
        if embeds_leaf is not None:                          # the graph is gone: so are the leaf and its .grad
            if embeds_leaf.grad is not None:
                self.decref(embeds_leaf.grad)
            embeds_leaf.grad = None
