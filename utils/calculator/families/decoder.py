"""A transformers decoder-only causal LM, replayed as transformers 5.24 trains it: the skeleton every transformers
family here shares (``TransformersDecoder``), with Llama's decoder layer as its default block.

What the skeleton does, each a thing ``modeling_llama`` (and its copies) does:

* ``position_ids`` (``arange(T) + past_seen_tokens``) live for the whole forward; the rotary embedding computes
  ``position_ids.float() * inv_freq`` (two buffers, ``inv_freq`` and ``original_inv_freq``);
* in training mode without checkpointing ``use_cache`` stays on: a ``DynamicCache`` keeps a copy (``torch.cat``)
  of every layer's keys and values, and attention runs on those copies; each sliding layer's cache holds a
  0-dim int64 of its window;
* the masks, one per kind of layer present (``layer_types``): sdpa without padding passes ``is_causal`` and no
  mask, unless a sliding window is shorter than the sequence; with padding (or eager attention) the 4-D mask is
  built once and every layer of its kind keeps it; sdpa with grouped-query attention and no mask passes
  ``enable_gqa`` instead of repeating the key/value heads;
* eager attention: ``q @ k^T * scale + mask``, a float32 softmax, dropout, ``@ v``, each saved as PyTorch saves
  it; attention dropout with sdpa sends the CPU to sdpa's math kernel;
* the loss and the output object (``loss.py``): ``labels=`` (the model's shifted loss), your own loss on the
  logits, notebook 17's summed loss; the reader's loop keeps the output object, or drops it
  (``TrainingSetup.outputs``);
* ``gradient_checkpointing_enable()`` checkpoints each decoder layer (non-reentrant by default, reentrant when
  asked), turns the cache off, and makes the embedding's output require grad;
* peft's LoRA (``lora_A``, ``lora_B`` as ``nn.Linear``, ``lora_dropout`` an ``nn.Identity`` at 0): the adapters
  stay float32 on a bf16 model (peft's ``autocast_adapter_dtype``), so peft casts their input to float32 and the
  sum back to the base layer's dtype.
"""

from __future__ import annotations

from typing import Any, Callable

from ..config import ModelConfig, TrainingSetup
from ..loss import transformers_loss, transformers_step_begin
from ..replay import _Leaf, _T
from .base import Family, check_fields, require, rope_settings
from .decoder_generation import GeneratingDecoder, kept_positions
from .hf_modules import (causal_mask, copy_cat, lora_linear, maybe_dropout, rms_norm, rope, rotary,
                         sdpa_math)

ATTENTION_PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj")
_COLUMN = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj", "qkv_proj", "gate_up_proj")
_ROW = ("o_proj", "down_proj")


class TransformersDecoder(GeneratingDecoder, Family):
    """transformers' decoder-only causal LMs: Llama's design, which the other families override piece by piece."""

    arch = ""
    needed = ("num_hidden_layers", "hidden_size", "num_attention_heads", "vocab_size", "intermediate_size")
    activations = ("silu",)                    # hidden_act values the MLP replays
    norm = staticmethod(rms_norm)

    # -- reading -------------------------------------------------------------------------------------------
    defaults: dict[str, dict[str, Any]] = {}   # model_type -> its config class's defaults this reader needs

    def read_config(self, fields: dict[str, Any], attention: str, name: str) -> ModelConfig:
        model_type = fields["model_type"]
        require(fields, self.needed, model_type)
        fields = {**self.defaults.get(model_type, {}), **{k: v for k, v in fields.items() if v is not None or
                                                          k not in self.defaults.get(model_type, {}) or
                                                          k in self.nullable}}
        check_fields(fields, self.rules[model_type].with_base(), f"transformers 5.24's {model_type} config")
        rope_settings(fields)
        act = fields.get("hidden_act", fields.get("hidden_activation", self.activations[0]))
        if act not in self.activations:
            raise ValueError(f"hidden_act {act!r} is not modelled: expected one of {self.activations}")
        heads = fields["num_attention_heads"]
        head_dim = fields.get("head_dim") or fields["hidden_size"] // heads
        return ModelConfig(**self.shape_fields(fields, head_dim), arch=self.arch, name=name, attention=attention,
                           **self.design_fields(fields))

    def shape_fields(self, fields: dict[str, Any], head_dim: int) -> dict[str, Any]:
        """The fields every decoder has, read into ``ModelConfig``'s."""
        heads = fields["num_attention_heads"]
        return dict(num_layers=fields["num_hidden_layers"], d_model=fields["hidden_size"], num_heads=heads,
                    vocab_size=fields["vocab_size"], ffn_width=fields["intermediate_size"],
                    num_kv_heads=fields.get("num_key_value_heads") or heads,
                    max_seq_len=fields.get("max_position_embeddings", 2048),
                    tied_embeddings=bool(fields.get("tie_word_embeddings", False)),
                    head_width=head_dim if head_dim * heads != fields["hidden_size"] else None,
                    use_cache=bool(fields.get("use_cache", True)))

    def design_fields(self, fields: dict[str, Any]) -> dict[str, Any]:
        """What this family reads beyond the shape (biases, window, dropout, layer types)."""
        raise NotImplementedError

    # -- checks --------------------------------------------------------------------------------------------
    def check_model(self, model: ModelConfig) -> None:
        if model.activation is not None:
            raise ValueError(f"activation {model.activation!r}: {self.arch} has one MLP activation (expected None)")
        if model.dropout[0]:
            raise ValueError(f"{self.arch} has no embedding dropout: expected dropout[0] == 0, got {model.dropout}")
        if model.dropout[2] and not self.residual_dropout:
            raise ValueError(f"{self.arch} has no residual dropout: expected dropout[2] == 0, got {model.dropout}")
        if model.extra:
            raise ValueError(f"{self.arch} reads no extra settings: expected extra=(), got {model.extra!r}")

    residual_dropout = False
    nullable = ("final_logit_softcapping", "attn_logit_softcapping", "sliding_window")   # None means "off"
    rotated_layout = "permuted"                # q and k after the rotary: a transposed view's layout (Phi-3: a cat's)

    def check_setup(self, model: ModelConfig, setup: TrainingSetup) -> None:
        if setup.chunked_loss:
            raise ValueError("a chunked loss is modelled for the course's designs: transformers' models compute "
                             "their loss on the whole logits (expected chunked_loss=0)")
        if setup.checkpointing == "selective":
            raise ValueError("transformers' gradient_checkpointing_enable() checkpoints whole layers: expected "
                             "checkpointing 'none' or 'every_block' for a transformers model")
        self.lora_targets(model, setup)                 # a target that names no module fails here

    def outputs(self, setup: TrainingSetup) -> str:
        return setup.outputs or ("dropped" if setup.loss == "shifted-sum" else "kept")

    def describe(self, model: ModelConfig, setup: TrainingSetup) -> str:
        loss = {"labels": "model(labels=)", "logits": "on the logits", "shifted-sum": "summed over the count"}
        outputs = {"kept": "outputs kept by the loop", "kept-in-step": "outputs kept until the step returns",
                   "dropped": "outputs dropped before backward"}[self.outputs(setup)]
        return (f"{model.attention} attention, loss {loss[setup.loss]}, {outputs}"
                f"{', padded batch' if setup.padded else ''}{', reentrant' if setup.reentrant else ''}, ")

    def divides_loss(self, setup: TrainingSetup) -> bool:
        return setup.accumulation_steps > 1 and setup.loss != "shifted-sum"   # notebook 17's divides by the count

    # -- parameters ----------------------------------------------------------------------------------------
    def block_parameters(self, model: ModelConfig) -> list[tuple]:
        """A block's parameters in ``parameters()`` order: ("linear", path, in, out, bias) or ("norm", path, width)."""
        d, f, hd = model.d_model, model.ffn, model.head_dim
        q, kv = model.num_heads * hd, model.kv_heads * hd
        return [("linear", "self_attn.q_proj", d, q, model.qkv_bias), ("linear", "self_attn.k_proj", d, kv, model.qkv_bias),
                ("linear", "self_attn.v_proj", d, kv, model.qkv_bias), ("linear", "self_attn.o_proj", q, d, model.out_bias),
                ("linear", "mlp.gate_proj", d, f, model.mlp_bias), ("linear", "mlp.up_proj", d, f, model.mlp_bias),
                ("linear", "mlp.down_proj", f, d, model.mlp_bias),
                ("norm", "input_layernorm", d), ("norm", "post_attention_layernorm", d)]

    def linears(self, model: ModelConfig) -> dict[str, tuple[int, int, bool]]:
        """A block's Linear layers: path -> (in, out, bias)."""
        return {entry[1]: entry[2:] for entry in self.block_parameters(model) if entry[0] == "linear"}

    def lora_targets(self, model: ModelConfig, setup: TrainingSetup) -> set[str]:
        if not setup.lora_rank:
            return set()
        paths = list(self.linears(model))
        if setup.lora_targets == "all":
            return set(paths)
        if setup.lora_targets == "attention":
            return {p for p in paths if p.startswith("self_attn.")}
        names = [p.rsplit(".", 1)[1] for p in paths]
        unknown = [t for t in setup.lora_targets if t.rsplit(".", 1)[-1] not in names]
        if unknown:
            raise ValueError(f"LoRA target(s) {unknown} name no Linear layer of a {model.name} block: expected names "
                             f"among {names} (peft's target_modules; 'all-linear' for every one of them)")
        wanted = {t.rsplit(".", 1)[-1] for t in setup.lora_targets}
        return {p for p in paths if p.rsplit(".", 1)[1] in wanted}

    def leaf_item(self, name: str, setup: TrainingSetup) -> int:
        if ".lora_A." in name or ".lora_B." in name:     # peft keeps its adapters in float32 on a bf16 model
            return 4
        return 2 if setup.precision == "bf16" else 4

    def parameter_shapes(self, model: ModelConfig, setup: TrainingSetup) -> list[tuple[str, tuple[int, ...], bool]]:
        lora = setup.lora_rank > 0
        targets = self.lora_targets(model, setup)
        d, v = model.d_model, model.vocab_size
        out: list[tuple[str, tuple[int, ...], bool]] = [("model.embed_tokens.weight", (v, d), not lora)]
        for layer in range(model.num_layers):
            prefix = f"model.layers.{layer}."
            for entry in self.block_parameters(model):
                if entry[0] == "norm":
                    out.append((prefix + entry[1] + ".weight", (entry[2],), not lora))
                    continue
                _, path, fan_in, fan_out, bias = entry
                base = prefix + path + (".base_layer" if path in targets else "")
                out.append((base + ".weight", (fan_out, fan_in), not lora))
                if bias:
                    out.append((base + ".bias", (fan_out,), not lora))
                if path in targets:                    # peft registers lora_A and lora_B after the base layer
                    out.append((prefix + path + ".lora_A.default.weight", (setup.lora_rank, fan_in), True))
                    out.append((prefix + path + ".lora_B.default.weight", (fan_out, setup.lora_rank), True))
        out.append(("model.norm.weight", (d,), not lora))
        if not model.tied_embeddings:
            out.append(("lm_head.weight", (v, d), not lora))
        return out

    def block_linear_weights(self, model: ModelConfig, setup: TrainingSetup) -> dict[str, tuple[int, int]]:
        targets = self.lora_targets(model, setup)
        return {f"model.layers.{layer}.{path}{'.base_layer' if path in targets else ''}.weight": (fan_out, fan_in)
                for layer in range(model.num_layers) for path, (fan_in, fan_out, _) in self.linears(model).items()}

    def tensor_parallel_dim(self, name: str, shape: tuple[int, ...]) -> int | None:
        owner, _, kind = name.rpartition(".")
        owner = owner.removesuffix(".base_layer")
        last = owner.rsplit(".", 1)[-1]
        if last in _COLUMN or last in ("embed_tokens", "lm_head"):
            return 0
        if last in _ROW:
            return 1 if kind == "weight" else None
        return None

    def activation_design(self) -> str:
        return "llama"

    def batch_arrays(self, setup: TrainingSetup) -> int:
        return 3 if setup.padded else 2              # token ids, labels (or targets), attention mask

    # -- what lives with the model -------------------------------------------------------------------------
    def buffers(self, r: Any) -> None:
        """The rotary embedding's ``inv_freq`` and ``original_inv_freq`` (in the model's dtype)."""
        item = 2 if r.setup.precision == "bf16" else 4
        for name in ("inv_freq", "original_inv_freq"):
            r.incref(r._alloc(r.model.head_dim // 2 * item, "parameters", f"rotary_emb.{name}"))

    def step_begin(self, r: Any) -> None:
        transformers_step_begin(r)

    # -- one micro-batch -----------------------------------------------------------------------------------
    def embed(self, r: Any) -> _T:
        """``embed_tokens(input_ids)``."""
        return r.embedding(r.p("model.embed_tokens.weight"), r.setup.tokens * r.model.d_model, "token embedding")

    def make_embeds_leaf(self, r: Any, x: _T) -> None:
        """``enable_input_require_grads`` under checkpointing: a frozen embedding's output becomes a leaf."""
        r.embeds_leaf = None
        if r.setup.checkpointing != "none" and not x.rg:
            r.embeds_leaf = _Leaf("inputs_embeds", (x.numel,), x.item, True)
            r.embeds_leaf.tensor = x
            x.rg, x.leaf = True, r.embeds_leaf
            r.incref(x.buf)                              # its AccumulateGrad keeps it until the graph goes

    def cache(self, r: Any) -> list[_T] | None:
        """``DynamicCache(config)``: None without a cache; each sliding layer holds ``torch.tensor(window)``."""
        model = r.model
        if not model.use_cache or r.setup.checkpointing != "none":
            return None
        r.set_phase(f"m{r.micro}.cache")                  # DynamicCache(config): each sliding layer's scalar
        scalars = [r.new(1, 8, "activations", "cache's sliding-window scalar", tag=i) for i in range(model.num_layers)
                   if model.layer_type(i) == "sliding_attention"]
        r.set_phase(f"m{r.micro}.embed")
        return scalars

    def masks(self, r: Any, cached: bool) -> dict[str, _T | None]:
        """The masks ``LlamaModel.forward`` makes: one per kind of layer (here: Llama's one causal mask, or
        Mistral's sliding one; Qwen2 and the others override)."""
        kind = r.model.layer_type(0)
        return {kind: causal_mask(r, r.model.sliding_window if kind == "sliding_attention" else None, cached)}

    def rotaries(self, r: Any) -> dict[str, tuple[_T, _T]]:
        """cos and sin per kind of layer (one rotary embedding for all)."""
        cos_sin = rotary(r)
        return {kind: cos_sin for kind in ("full_attention", "sliding_attention")}

    def forward(self, r: Any, micro: int) -> _T:
        """``loss = model(input_ids, attention_mask=..., labels=...).loss`` (or the reader's own loss)."""
        logits, final, cache = self.forward_logits(r, micro)
        return transformers_loss(r, micro, logits, final, cache or [])

    def forward_logits(self, r: Any, micro: int, keep: int = 0) -> tuple[_T, _T, list[_T] | None]:
        """``model(input_ids, ...)`` up to its logits: (logits, the last hidden state, the cache's tensors).
        ``keep``: ``logits_to_keep`` (0: every position; notebook 15's RL step keeps the answer's)."""
        model, setup = r.model, r.setup
        x = self.embed(r)
        inputs_embeds = r.view(x)                        # the model's local, alive until it returns
        self.make_embeds_leaf(r, x)
        cache = self.cache(r)
        arange = r.new(setup.seq_len, 8, "temporaries", "arange(T)")
        position_ids = r.new(setup.seq_len, 8, "activations", "position_ids")
        r.rel(arange)
        masks = self.masks(r, cache is not None)
        rotaries = self.rotaries(r)
        x = self.layers(r, micro, x, rotaries, masks, cache, position_ids)
        r.set_phase(f"m{micro}.head")
        final = self.norm(r, x, r.p("model.norm.weight"), "model.norm")
        r.rel(x)
        r.rel(position_ids, inputs_embeds, *masks.values())         # the model's forward returns: its locals go
        for cos, sin in {id(pair): pair for pair in rotaries.values()}.values():
            r.rel(cos, sin)
        w = r.p("model.embed_tokens.weight" if model.tied_embeddings else "lm_head.weight")
        kept = kept_positions(r, final, keep, setup.micro_batch, setup.seq_len, w)
        logits = self.head(r, kept, w)
        if kept is not final:
            r.rel(kept)
        return logits, final, cache

    def layers(self, r: Any, micro: int, x: _T, rotaries: dict, masks: dict, cache: list[_T] | None,
               position_ids: _T) -> _T:
        """The decoder layers, each with the masks and cos/sin of its kind (kept by the checkpoint too)."""
        model = r.model

        def block(layer: int) -> Callable:
            kind = model.layer_type(layer)
            return self.block(r, layer, rotaries[kind], masks.get(kind), cache)

        def extra(layer: int) -> list[_T]:
            kind = model.layer_type(layer)
            mask = masks.get(kind)
            return [*rotaries[kind], position_ids] + ([mask] if mask is not None else [])

        return r.run_layers(micro, x, block, extra)

    def head(self, r: Any, final: _T, w: _T) -> _T:
        """``lm_head(hidden_states)``: the logits."""
        return r.linear(final, w, None, r.model.vocab_size, "logits")

    def after_backward(self, r: Any, micro: int) -> None:
        give_graph_the_embeds_leaf(r)

    # -- one decoder layer ---------------------------------------------------------------------------------
    def linear(self, r: Any, x: _T, prefix: str, path: str) -> _T:
        fan_in, fan_out, bias = self.linears(r.model)[path]
        if not hasattr(r, "_lora_paths"):
            r._lora_paths = self.lora_targets(r.model, r.setup)
        return lora_linear(r, x, prefix, path, fan_out, bias, r._lora_paths)

    def attend(self, r: Any, q: _T, k: _T, v: _T, mask: _T | None, label: str, cached: bool,
               softcap: bool = False) -> _T:
        """``sdpa_attention_forward`` or ``eager_attention_forward``: (B, H, T, hd) in, (B, T, H * hd) out.

        ``cached``: k and v are the cache's contiguous copies (else k has the rotary output's transposed layout
        and v is a transposed view of the projection). ``softcap``: Gemma 2's ``tanh(scores / cap) * cap``."""
        model, setup = r.model, r.setup
        groups = model.num_heads // model.kv_heads
        b, t, h = setup.micro_batch, setup.seq_len, model.num_heads
        p = model.dropout[1]
        if model.attention == "sdpa":
            gqa = groups > 1 and mask is None and model.head_dim <= 256
            if groups > 1 and not gqa:
                k, v = r.repeat_kv(k, groups, label + " repeat_kv(key)"), r.repeat_kv(v, groups, label + " repeat_kv(value)")
            else:
                k, v = r.view(k), r.view(v)
            if p and r.device == "cpu":                  # dropout: sdpa's math kernel, op by op
                layout = "contiguous" if cached or (groups > 1 and not gqa) else self.rotated_layout
                out = sdpa_math(r, q, k, v, mask, label, layout, groups if gqa else 1, self.rotated_layout)
            else:
                # a bool mask becomes a float one inside sdpa, per layer: where(mask, 0, -inf) in the query's dtype
                out = r.sdpa(q, k, v, b * h * t, label, b * t * t if mask is not None else None)
                if self.rotated_layout == "contiguous":  # the kernel's output follows q's layout: transposing
                    moved = r.contiguous(out, label + " transpose(1, 2).contiguous()")   # it back copies
                    r.rel(out)
                    out = moved
            r.rel(k, v)
            return out
        source = "contiguous" if cached else self.rotated_layout
        k_layout = source if groups == 1 else ("expanded" if model.kv_heads == 1 else "contiguous")
        v_layout = source if groups == 1 else ("expanded" if model.kv_heads == 1 else "contiguous")
        k_rep = r.repeat_kv(k, groups, label + " repeat_kv(key)")
        v_rep = r.repeat_kv(v, groups, label + " repeat_kv(value)")
        scores = r.bmm(q, k_rep, b * h * t * t, label + " q @ k^T", (self.rotated_layout, k_layout), b)
        scaled = r.mul_scalar(scores, label + " * scaling")
        r.rel(scores)
        if softcap:                                      # attn_weights / softcap, tanh, * softcap
            divided = r.mul_scalar(scaled, label + " / softcap")
            r.rel(scaled)
            capped = r.unary(divided, "Tanh", label + " tanh", save_output=True)
            r.rel(divided)
            scaled = r.mul_scalar(capped, label + " * softcap")
            r.rel(capped)
        masked = r.add(scaled, mask, label + " + mask", numel=scaled.numel) if mask is not None else r.view(scaled)
        r.rel(scaled)
        probs = r.softmax(masked, label + " softmax")     # softmax(w, dtype=float32).to(query.dtype): then the
        low = r.to_float(probs, label + " .to(query.dtype)", "activations", q.item)   # old `attn_weights` goes
        r.rel(masked, probs)
        weights = maybe_dropout(r, low, p, label + " attention dropout")
        r.rel(low)
        mixed = r.bmm(weights, v_rep, q.numel, label + " weights @ v", ("contiguous", v_layout), b)
        out = r.contiguous(mixed, label + " transpose(1, 2).contiguous()", copy_grad=b > 1)
        r.rel(mixed, k_rep, v_rep)                        # eager_attention_forward returns: its locals go, but
        r.attention_weights = weights                     # the weights it returns are the layer's `_` until it does
        return out

    def project_qkv(self, r: Any, prefix: str, n1: _T, cos: _T, sin: _T, mask: _T | None) -> tuple[_T, _T, _T]:
        """q, k, v: projections viewed (B, H, T, hd), q and k rotated."""
        model = r.model
        groups = model.num_heads // model.kv_heads
        views = []
        # reshaping a gradient back through .view().transpose(1, 2) copies it unless it arrives in the transposed
        # layout: sdpa's own gradients do (the CPU and CUDA kernels work in (B, T, H, hd)); those of the rotary
        # embedding, of repeat_kv's sum, of eager attention's bmm and of sdpa's math kernel do not
        repeated_v = (model.attention == "eager" or (groups > 1 and mask is not None)
                      or (model.dropout[1] > 0 and r.device == "cpu"))
        for path, copy_grad in (("self_attn.q_proj", model.num_heads > 1), ("self_attn.k_proj", model.kv_heads > 1),
                                ("self_attn.v_proj", repeated_v and model.kv_heads > 1)):
            out = self.linear(r, n1, prefix, path)       # .view(B, T, heads, hd).transpose(1, 2)
            views.append(r.reshape_copy(out, prefix + path, copy_grad))
            r.rel(out)
        q, k, v = views
        q_rot = rope(r, q, cos, sin, prefix + "query")
        k_rot = rope(r, k, cos, sin, prefix + "key")
        r.rel(q, k)
        return q_rot, k_rot, v

    def self_attention(self, r: Any, layer: int, n1: _T, cos: _T, sin: _T, mask: _T | None,
                       cache: list[_T] | None) -> _T:
        """``LlamaAttention.forward``: projections, rotary, the cache's copies, attention, ``o_proj``."""
        prefix = f"model.layers.{layer}."
        if getattr(r, "generating", None) is not None:   # inside generate (calculator/generate.py): its cache
            return self.generating_attention(r, layer, n1, cos, sin, mask)
        q_rot, k_rot, v = self.project_qkv(r, prefix, n1, cos, sin, mask)
        if cache is not None:                            # DynamicCache.update: torch.cat([empty, states])
            k_cached = copy_cat(r, k_rot, prefix + "cache keys")
            v_cached = copy_cat(r, v, prefix + "cache values")
            r.rel(k_rot, v)
            k_rot, v = k_cached, v_cached
            cache.extend([r.view(k_cached), r.view(v_cached)])
        r.attention_weights = None
        attended = self.attend(r, q_rot, k_rot, v, mask, prefix + "attention", cache is not None)
        attn = self.linear(r, attended, prefix, "self_attn.o_proj")
        r.rel(attended, q_rot, k_rot, v)
        return attn

    def mlp(self, r: Any, prefix: str, n2: _T) -> _T:
        """``down_proj(act_fn(gate_proj(x)) * up_proj(x))``."""
        gate = self.linear(r, n2, prefix, "mlp.gate_proj")
        act = self.activation(r, gate, prefix + "mlp.act_fn")
        r.rel(gate)
        up = self.linear(r, n2, prefix, "mlp.up_proj")
        product = r.mul(act, up, prefix + "act * up")
        r.rel(act, up)
        down = self.linear(r, product, prefix, "mlp.down_proj")
        r.rel(product)
        return down

    def activation(self, r: Any, x: _T, label: str) -> _T:
        """SiLU (Gemma: gelu_pytorch_tanh)."""
        return r.unary(x, "Silu", label, save_input=True)

    def block(self, r: Any, layer: int, cos_sin: tuple[_T, _T], mask: _T | None,
              cache: list[_T] | None) -> Callable:
        """``LlamaDecoderLayer.forward`` for one layer."""
        prefix = f"model.layers.{layer}."
        cos, sin = cos_sin

        def block(r_: Any, x: _T) -> _T:
            n1 = self.norm(r, x, r.p(prefix + "input_layernorm.weight"), prefix + "input_layernorm")
            attn = self.self_attention(r, layer, n1, cos, sin, mask, cache)
            weights = r.attention_weights                # eager's, returned as `_`: a local of the layer
            r.rel(n1)                                    # LlamaAttention.forward's locals, then the layer's
            x1 = r.add(x, attn, prefix + "residual 1")
            r.rel(attn)
            n2 = self.norm(r, x1, r.p(prefix + "post_attention_layernorm.weight"), prefix + "post_attention_layernorm")
            down = self.mlp(r, prefix, n2)
            r.rel(n2)
            x2 = r.add(x1, down, prefix + "residual 2")
            r.rel(down, x1, weights)
            return x2

        return block


def give_graph_the_embeds_leaf(r: Any) -> None:
    """The leaf ``enable_input_require_grads`` made, and its ``.grad``, are kept by its ``AccumulateGrad`` node: they
    go with the graph (``r.free_graph``)."""
    leaf = getattr(r, "embeds_leaf", None)
    if leaf is None:
        return
    if leaf.grad is not None:
        r.graph_refs.append(_T(leaf.grad, leaf.numel, leaf.item))
    leaf.grad = None
    r.graph_refs.append(_T(leaf.tensor.buf, leaf.numel, leaf.item))
    r.embeds_leaf = None
