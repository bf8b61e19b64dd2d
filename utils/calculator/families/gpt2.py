"""transformers' GPT-2 (``GPT2LMHeadModel``): its config read, its parameters as transformers and peft name them, and
its step replayed.

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

from typing import Any, Callable

from ..config import GPT2_ACTIVATIONS, ModelConfig, TrainingSetup
from ..loss import transformers_loss, transformers_step_begin
from ..registry import register
from ..replay import _Leaf, _T
from .base import Family, FieldRules, check_fields, require
from .decoder import give_graph_the_embeds_leaf
from .hf_modules import causal_mask, copy_cat, dropout, maybe_dropout, peft_lora_add, sdpa_math

RULES = {"gpt2": FieldRules(
    frozenset({"n_layer", "n_embd", "n_head", "n_inner", "n_positions", "vocab_size", "activation_function",
               "embd_pdrop", "attn_pdrop", "resid_pdrop", "tie_word_embeddings", "use_cache"}),
    {"n_ctx": "the older name of n_positions", "summary_type": "GPT2DoubleHeadsModel's summary head, not the LM's",
     "summary_use_proj": "GPT2DoubleHeadsModel's summary head", "summary_activation": "GPT2DoubleHeadsModel's",
     "summary_proj_to_labels": "GPT2DoubleHeadsModel's summary head",
     "summary_first_dropout": "GPT2DoubleHeadsModel's summary head"},
    {"add_cross_attention": False, "reorder_and_upcast_attn": False, "scale_attn_weights": True,
     "scale_attn_by_inverse_layer_idx": False})}


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


class Gpt2(Family):
    """``GPT2LMHeadModel`` (peft-wrapped under LoRA)."""

    arch = "hf-gpt2"
    model_types = ("gpt2",)
    rules = RULES

    def read_config(self, fields: dict[str, Any], attention: str, name: str) -> ModelConfig:
        require(fields, ("n_layer", "n_embd", "n_head", "vocab_size"), "gpt2")
        act = fields.get("activation_function", "gelu_new")
        if act not in GPT2_ACTIVATIONS:
            raise ValueError(f"GPT-2 activation_function {act!r} is not modelled: expected one of {GPT2_ACTIVATIONS}")
        check_fields(fields, self.rules["gpt2"].with_base(), "transformers 5.24's GPT2Config")
        dropout_ = tuple(float(fields.get(key, 0.1)) for key in ("embd_pdrop", "attn_pdrop", "resid_pdrop"))
        return ModelConfig(num_layers=fields["n_layer"], d_model=fields["n_embd"], num_heads=fields["n_head"],
                           vocab_size=fields["vocab_size"], ffn_width=fields.get("n_inner") or 4 * fields["n_embd"],
                           max_seq_len=fields.get("n_positions", 1024), arch=self.arch,
                           tied_embeddings=fields.get("tie_word_embeddings", True), name=name, attention=attention,
                           use_cache=fields.get("use_cache", True), dropout=dropout_, activation=act)

    def check_model(self, model: ModelConfig) -> None:
        if model.kv_heads != model.num_heads:
            raise ValueError("GPT-2 has one key/value head per query head: expected num_kv_heads None or "
                             f"{model.num_heads}, got {model.num_kv_heads}")
        if model.activation is not None and model.activation not in GPT2_ACTIVATIONS:
            raise ValueError(f"activation {model.activation!r}: expected None (gelu_new) or one of {GPT2_ACTIVATIONS}")
        given = [name for name in ("head_width", "sliding_window", "layer_types") if getattr(model, name) is not None]
        given += [name for name in ("qkv_bias", "out_bias", "mlp_bias") if getattr(model, name)] + (
            ["extra"] if model.extra else [])
        if given:
            raise ValueError(f"{', '.join(given)}: GPT-2 has none of them (its projections all have biases)")

    def check_setup(self, model: ModelConfig, setup: TrainingSetup) -> None:
        if setup.chunked_loss:
            raise ValueError("a chunked loss is modelled for the course's designs: transformers' models compute "
                             "their loss on the whole logits (expected chunked_loss=0)")
        if setup.checkpointing == "selective":
            raise ValueError("transformers' gradient_checkpointing_enable() checkpoints whole layers: expected "
                             "checkpointing 'none' or 'every_block' for a transformers model")
        gpt2_lora_targets(model, setup)

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

    def parameter_shapes(self, model: ModelConfig, setup: TrainingSetup) -> list[tuple[str, tuple[int, ...], bool]]:
        return gpt2_parameter_shapes(model, setup)

    def lora_targets(self, model: ModelConfig, setup: TrainingSetup) -> set[str]:
        return gpt2_lora_targets(model, setup)

    def leaf_item(self, name: str, setup: TrainingSetup) -> int:
        if ".lora_A." in name or ".lora_B." in name:     # peft keeps its adapters in float32 on a bf16 model
            return 4
        return 2 if setup.precision == "bf16" else 4

    def batch_arrays(self, setup: TrainingSetup) -> int:
        return 3 if setup.padded else 2

    def step_begin(self, r: Any) -> None:
        transformers_step_begin(r)

    def layer_signature(self, model: ModelConfig, layer: int) -> str:
        return "gpt2 block"

    def peft_default_targets(self, model: ModelConfig) -> tuple[str, ...]:
        return ("c_attn",)

    def activation_design(self) -> str:
        raise ValueError("GPT-2's Conv1D weights are stored transposed and its step is not replayed under model "
                         "parallelism: expected a design 'gpt', 'llama' or 'hf-llama'")

    def transformers_config(self, model: ModelConfig) -> Any:
        """The transformers config of a ``ModelConfig`` of this family (for measuring it)."""
        import transformers

        return transformers.GPT2Config(n_layer=model.num_layers, n_embd=model.d_model, n_head=model.num_heads,
                                       vocab_size=model.vocab_size, n_positions=model.max_seq_len,
                                       n_inner=model.ffn if model.ffn != 4 * model.d_model else None,
                                       tie_word_embeddings=model.tied_embeddings, use_cache=model.use_cache,
                                       embd_pdrop=model.dropout[0], attn_pdrop=model.dropout[1],
                                       resid_pdrop=model.dropout[2], activation_function=model.activation or "gelu_new",
                                       # GPT-2's token ids (50256) inside a tiny vocabulary (transformers warns)
                                       bos_token_id=min(50256, model.vocab_size - 1),
                                       eos_token_id=min(50256, model.vocab_size - 1))

    def conv1d(self, r: Any, x: _T, prefix: str, path: str) -> _T:
        """``Conv1D``: ``addmm(bias, x.view(-1, in), weight)`` (weight (in, out)); under LoRA peft's ``lora.Linear``
        (``fan_in_fan_out=True``): ``base(x) + lora_B(lora_A(dropout(x))) * scaling``."""
        fan_out = {p: o for p, _, o in gpt2_conv1ds(r.model)}[path]
        lora = path in self.lora_targets(r.model, r.setup)
        base = prefix + path + (".base_layer" if lora else "")
        w, b = r.p(base + ".weight"), r.p(base + ".bias")
        if r.autocast:                                   # autocast casts addmm's weight, input, then bias
            wc = r.cast16(w, f"{prefix}{path}.weight bf16")
            xc = r.cast16(x, f"{prefix}{path} input bf16")
            bc = r.cast16(b, f"{prefix}{path}.bias bf16")
        else:
            wc, xc, bc = r.view(w), r.view(x), r.view(b)
        casts = [wc, xc, bc]
        saved = ([xc] if wc.rg else []) + ([wc] if xc.rg else [])
        n = r.node(f"AddmmBackward {prefix}{path}", [(bc, "pass"), (xc, "alloc"), (wc, "alloc")], order=[1, 2],
                      saved=saved)
        rows = x.numel // (w.numel // fan_out)
        result = r.output(r.new(rows * fan_out, r.act_item(xc, wc), "activations", prefix + path), n)
        r.rel(*casts)
        if not lora:
            return result
        return peft_lora_add(r, x, result, prefix, path, fan_out)

    def gelu_new(self, r: Any, x: _T, label: str) -> _T:
        """``NewGELUActivation``: ``0.5 * x * (1.0 + tanh(sqrt(2 / pi) * (x + 0.044715 * pow(x, 3.0))))``, op by op:
        it keeps x (pow's), the tanh, ``0.5 * x`` and ``1 + tanh`` for backward."""
        half = r.mul_scalar(x, label + " 0.5 * x")
        cube = r.unary(x, "Pow", label + " pow(x, 3)", save_input=True, temps=2)
        scaled = r.mul_scalar(cube, label + " 0.044715 * x^3")
        r.rel(cube)
        inner = r.add(x, scaled, label + " x + 0.044715 x^3")
        r.rel(scaled)
        arg = r.mul_scalar(inner, label + " * sqrt(2 / pi)")
        r.rel(inner)
        th = r.unary(arg, "Tanh", label + " tanh", save_output=True)
        r.rel(arg)
        one_plus = r.add_scalar(th, label + " 1 + tanh")
        r.rel(th)
        out = r.mul(half, one_plus, label)
        r.rel(half, one_plus)
        return out

    def gpt2_activation(self, r: Any, x: _T, label: str) -> _T:
        if (r.model.activation or "gelu_new") == "gelu_new":
            return self.gelu_new(r, x, label)
        return r.gelu(x, label)                                  # F.gelu (approximate "tanh" or "none")

    def gpt2_attention(self, r: Any, q: _T, k: _T, v: _T, mask: _T | None, label: str, cached: bool) -> _T:
        """``sdpa_attention_forward`` or GPT-2's ``eager_attention_forward``: (B, H, T, hd) in, (B, T, d) out."""
        model, setup = r.model, r.setup
        b, t, h = setup.micro_batch, setup.seq_len, model.num_heads
        p = model.dropout[1]
        # the flash kernel; with attention dropout on CUDA too (it drops out inside; not measured on a GPU yet)
        if model.attention == "sdpa" and (not p or r.device == "cuda"):
            return r.sdpa(q, k, v, b * h * t, label, b * t * t if mask is not None else None)
        k_layout = "contiguous" if cached else "permuted"         # the cache's copies, or views of c_attn's output
        if model.attention == "sdpa":                             # dropout: sdpa's math kernel, op by op
            return sdpa_math(r, q, k, v, mask, label, k_layout)
        scores = r.bmm(q, k, b * h * t * t, label + " q @ k^T", ("permuted", k_layout), b)     # eager
        scaled = r.mul_scalar(scores, label + " * scaling")
        r.rel(scores)
        masked = r.add(scaled, mask, label + " + mask", numel=scaled.numel)
        r.rel(scaled)
        probs = r.unary(masked, "Softmax", label + " softmax", save_output=True)
        r.rel(masked)
        low = r.to_float(probs, label + " .type(value.dtype)", "activations", v.item)
        r.rel(probs)
        dropped = dropout(r, low, label + " attn_dropout") if p else r.view(low)
        r.rel(low)
        out = r.bmm(dropped, v, q.numel, label + " weights @ v", ("contiguous", k_layout), b)
        r.attention_weights = dropped                          # returned: `attn_output, _ = self.attn(...)`
        mixed = r.contiguous(out, label + " .reshape(B, T, d)", copy_grad=b > 1)
        r.rel(out)
        return mixed

    def gpt2_block(self, r: Any, layer: int, mask: _T | None, cache: list[_T] | None) -> Callable:
        """``GPT2Block.forward`` for one layer."""
        prefix = f"transformer.h.{layer}."
        model = r.model
        resid_p = model.dropout[2]

        def block(r_: Any, x: _T) -> _T:
            n1 = r.layer_norm(x, r.p(prefix + "ln_1.weight"), r.p(prefix + "ln_1.bias"), model.d_model,
                                 prefix + "ln_1")
            qkv = self.conv1d(r, n1, prefix, "attn.c_attn")
            q, k, v = r.split3(qkv, prefix + "attn split")
            r.rel(qkv)
            # .view(B, T, H, hd).transpose(1, 2): reshaping a gradient back copies it unless it arrives in the
            # transposed layout: the flash kernel's do; those of a matmul do not, except the key's (it entered
            # transposed)
            if model.attention == "eager" or model.dropout[1]:
                q_view, v_view = q, v
                q = r.reshape_copy(q_view, prefix + "query", model.num_heads > 1)
                v = r.reshape_copy(v_view, prefix + "value", model.num_heads > 1)
                r.rel(q_view, v_view)
            if cache is not None:                            # DynamicCache.update: torch.cat([empty, states])
                k_cached = copy_cat(r, k, prefix + "cache keys")
                v_cached = copy_cat(r, v, prefix + "cache values")
                r.rel(k, v)
                k, v = k_cached, v_cached
                cache.extend([r.view(k_cached), r.view(v_cached)])
            r.attention_weights = None
            attended = self.gpt2_attention(r, q, k, v, mask, prefix + "attention", cache is not None)
            weights = r.attention_weights                 # eager's: a local of the block ("_")
            proj = self.conv1d(r, attended, prefix, "attn.c_proj")
            r.rel(attended)
            attn = maybe_dropout(r, proj, resid_p, prefix + "attn.resid_dropout")
            r.rel(proj, q, k, v)                          # GPT2Attention.forward returns
            x1 = r.add(attn, x, prefix + "residual 1")   # attn_output stays a local of the block
            r.rel(n1)
            n2 = r.layer_norm(x1, r.p(prefix + "ln_2.weight"), r.p(prefix + "ln_2.bias"), model.d_model,
                                 prefix + "ln_2")
            fc = self.conv1d(r, n2, prefix, "mlp.c_fc")
            act = self.gpt2_activation(r, fc, prefix + "mlp.act")
            r.rel(fc)
            down = self.conv1d(r, act, prefix, "mlp.c_proj")
            r.rel(act)
            ff = maybe_dropout(r, down, resid_p, prefix + "mlp.dropout")
            r.rel(down)                                   # GPT2MLP.forward returns
            x2 = r.add(x1, ff, prefix + "residual 2")
            r.rel(n2, attn, x1, ff, weights)              # the block returns: its locals go
            return x2

        return block

    def forward(self, r: Any, micro: int) -> _T:
        """``loss = model(input_ids, attention_mask=..., labels=...).loss`` (or your own loss on the logits) for
        ``GPT2LMHeadModel``."""
        model, setup = r.model, r.setup
        d, n_tok = model.d_model, setup.tokens
        ckpt = setup.checkpointing != "none"
        tok = r.embedding(r.p("transformer.wte.weight"), n_tok * d, "wte")
        r.embeds_leaf = None
        if ckpt and not tok.rg:                            # enable_input_require_grads: the output becomes a leaf
            r.embeds_leaf = _Leaf("inputs_embeds", (n_tok * d,), tok.item, True)
            r.embeds_leaf.tensor = tok
            tok.rg, tok.leaf = True, r.embeds_leaf
            r.incref(tok.buf)                              # its AccumulateGrad keeps it until the graph goes
        cache: list[_T] | None = [] if model.use_cache and not ckpt else None
        arange = r.new(setup.seq_len, 8, "temporaries", "arange(T)")
        position_ids = r.new(setup.seq_len, 8, "activations", "position_ids")
        r.rel(arange)
        pos = r.embedding(r.p("transformer.wpe.weight"), setup.seq_len * d, "wpe", position_ids)
        x = r.add(tok, pos, "inputs_embeds + position_embeds", numel=n_tok * d)
        mask = causal_mask(r, None, cache is not None)
        dropped = maybe_dropout(r, x, model.dropout[0], "transformer.drop")
        r.rel(x)
        x = dropped
        x = r.run_layers(micro, x, lambda layer: self.gpt2_block(r, layer, mask, cache),
                         lambda layer: [position_ids] + ([mask] if mask is not None else []))
        r.set_phase(f"m{micro}.head")
        final = r.layer_norm(x, r.p("transformer.ln_f.weight"), r.p("transformer.ln_f.bias"), d, "transformer.ln_f")
        r.rel(x)
        r.rel(tok, pos, position_ids, mask)               # GPT2Model.forward returns: its locals go
        w = r.p("transformer.wte.weight" if model.tied_embeddings else "lm_head.weight")
        logits = r.linear(final, w, None, model.vocab_size, "logits")
        return transformers_loss(r, micro, logits, final, cache or [])

    def after_backward(self, r: Any, micro: int) -> None:
        give_graph_the_embeds_leaf(r)


register(Gpt2())
