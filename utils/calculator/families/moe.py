"""What transformers' mixtures of experts share, replayed as transformers 5.24 trains them: the sparse MoE block,
peft's LoRA on the experts, the routing (the families: ``mixtral.py``, ``qwen3_moe.py``, ``olmoe.py``).

Introduced in notebook 14 (mixture of experts). Each decoder layer's MLP is a sparse MoE block (Qwen3-MoE's
``mlp_only_layers`` and ``decoder_sparse_step`` keep a dense SwiGLU MLP in some layers):

* the router (``mlp.gate``, an ``(E, C)`` weight applied with ``F.linear``, not an ``nn.Linear``: bitsandbytes leaves
  it 16-bit): the logits, a float32 softmax, ``topk``; Mixtral always renormalises the ``k`` weights (an in-place
  division: autograd keeps a copy of the weights before it), Qwen3-MoE and OLMoE when ``norm_topk_prob``, and cast
  them back to the logits' dtype (Mixtral keeps them float32);
* the experts, two 3-D parameters ``gate_up_proj`` ``(E, 2F, C)`` and ``down_proj`` ``(E, C, F)``, run by
  ``experts_implementation="grouped_mm"``, transformers' default wherever ``F.grouped_mm`` runs (torch >= 2.10 on
  the CPU; compute capability >= 8.0 on CUDA): the ``T·k`` (token, slot) pairs sorted by expert, the tokens
  gathered (``hidden[perm // k]``), one grouped matmul up, SiLU times up, one grouped matmul down, the weights
  multiplied in, the pairs put back in order and summed per token. Autograd keeps the gathered tokens, the
  gate-and-up output, the SiLU and the product, the down output and the gathered weights, and three int64
  permutations; grouped matmuls run outside autocast, so under ``bf16-autocast`` the experts compute in fp32. The
  experts are not ``nn.Linear``: a 4-bit loader (QLoRA) leaves them 16-bit, and quantises the attention alone;
* peft 0.21's LoRA on the experts (``ParamWrapper``, which its conversion of transformers v4 names sets up for
  ``gate_proj``/``up_proj``/``down_proj``, Mixtral's ``w1``/``w3``/``w2``): float32 adapters ``(rank·E, in)`` and
  ``(out, rank·E)`` (gate_up_proj's with twice the rank), and in each forward the merged weight ``W + B @ A``, a
  copy of the whole stack (computed once more and freed when the parametrization is registered), which autograd
  keeps until the layer's backward: LoRA on the experts holds a second copy of every expert's weights per layer.

What the bytes depend on. Every tensor of the grouped path has ``T·k`` rows, never one expert's count: a step's
bytes depend on ``T`` and ``k``, not on how the router spread the pairs (measured: the tiny models of the grid at
three seeds, three routings, one peak). The routing is an input all the same (``TrainingSetup.routing``:
``"balanced"``, or tokens per expert per MoE layer), checked against ``T·k`` and ``E`` here, because where the
experts are split over ranks (``model_parallel``'s ``ep``) each rank receives the pairs of its own experts, and the
busiest rank sets the memory of all. Refused, with a message that names them: the other experts implementations
(``"eager"``, a loop over the experts hit, whose bytes do depend on the routing; ``"batched_mm"``, kernels from the
Hub), ``output_router_logits`` (the auxiliary loss and the router logits the output keeps), Mixtral's
``router_jitter_noise``, OLMoE's ``clip_qkv``; other MoE designs (shared experts: Qwen2-MoE, DeepSeek-V3; sigmoid or
grouped routing; MLA) have no family here.
"""

from __future__ import annotations

from typing import Any, Hashable

from ..config import ModelConfig, TrainingSetup
from ..replay import _T
from .base import FieldRules
from .decoder import TransformersDecoder
from .llama import RULES as LLAMA_RULES
from .moe_ops import baddbmm, grouped_mm, index, renormalise, topk

EXPERTS_IMPLEMENTATIONS = ("grouped_mm",)       # replayed; transformers' others are refused

_ROPE_THETA = {"rope_theta": "a number inside inv_freq (the older place of rope_parameters' rope_theta)"}
_SHAPE = LLAMA_RULES["llama"].replayed - {"attention_bias", "mlp_bias", "head_dim"}
_MOE = {"num_experts_per_tok", "experts_implementation"}
# output_router_logits: the outputs would keep every layer's router logits and the loss add the load-balancing loss
_REFUSED = {"output_router_logits": False}
_AUX = {"router_aux_loss_coef": "the auxiliary loss's weight: the loss exists only with output_router_logits, refused"}
RULES = {
    "mixtral": FieldRules(frozenset(_SHAPE | _MOE | {"head_dim", "sliding_window", "num_local_experts", "num_experts"}),
                          {**_AUX, **_ROPE_THETA},
                          {**_REFUSED, "router_jitter_noise": 0.0}),   # noise times the router's input, in place
    "qwen3_moe": FieldRules(frozenset(_SHAPE | _MOE | {"head_dim", "attention_bias", "use_sliding_window",
                                                       "sliding_window", "num_experts", "num_local_experts",
                                                       "moe_intermediate_size", "norm_topk_prob", "mlp_only_layers",
                                                       "decoder_sparse_step"}),
                            {**_AUX, **_ROPE_THETA,
                             "max_window_layers": "a key of Qwen3-MoE's config.json that transformers 5.24's "
                                                  "Qwen3MoeConfig ignores (with use_sliding_window every layer "
                                                  "slides)",
                             "layer_types": "a key transformers 5.24's Qwen3-MoE does not read (its mask is one for "
                                            "every layer)"},
                            dict(_REFUSED)),
    "olmoe": FieldRules(frozenset(_SHAPE | _MOE | {"attention_bias", "num_experts", "num_local_experts",
                                                   "norm_topk_prob"}),
                        {**_AUX, **_ROPE_THETA},
                        {**_REFUSED, "clip_qkv": None}),                # an in-place clamp of q, k and v
}


def _setting(model: ModelConfig, name: str) -> Any:
    return model.setting(name)


def routed_counts(model: ModelConfig, setup: TrainingSetup) -> list[tuple[int, ...]]:
    """Tokens per expert of each MoE layer for one micro-batch: ``setup.routing`` checked, or balanced.

    Balanced: each expert gets ``T·k // E`` pairs, the first ``T·k mod E`` one more (so they sum to ``T·k``).

    Raises:
        ValueError: counts that are not ``E`` per layer, that do not sum to ``T·k``, or a number of layers that is
            not the model's MoE layers (each message says what was expected).
    """
    experts, k = _setting(model, "experts"), _setting(model, "top_k")
    layers = [i for i in range(model.num_layers) if i not in _setting(model, "dense_layers")]
    pairs = setup.tokens * k
    routing = setup.routing
    if routing is None or routing == "balanced":
        even = tuple(pairs // experts + (e < pairs % experts) for e in range(experts))
        return [even] * len(layers)
    per_layer = [routing] * len(layers) if isinstance(routing[0], int) else list(routing)
    if len(per_layer) != len(layers):
        raise ValueError(f"routing gives {len(per_layer)} layers of tokens per expert, and {model.name} has "
                         f"{len(layers)} MoE layers: expected one list per MoE layer, or one list for all")
    for layer, counts in zip(layers, per_layer):
        if len(counts) != experts:
            raise ValueError(f"routing of layer {layer}: {len(counts)} counts for {experts} experts: expected one "
                             "count per expert")
        if sum(counts) != pairs:
            raise ValueError(f"routing of layer {layer} sums to {sum(counts)} pairs: expected micro_batch x seq_len "
                             f"x k = {setup.micro_batch} x {setup.seq_len} x {k} = {pairs} (every token goes to k "
                             "experts)")
    return [tuple(counts) for counts in per_layer]


class MoEDecoder(TransformersDecoder):
    """What Mixtral, Qwen3-MoE and OLMoE share: the sparse MoE block, its parameters, the routing's checks."""

    routes_tokens = True                       # predict's check: this family takes TrainingSetup.routing
    router_casts_back = True                   # router_top_value.to(router_logits.dtype) (Mixtral: no)
    always_renormalises = False                # Mixtral: the top-k weights always sum to 1
    experts_key = "num_experts"                # the config's name for E (Mixtral, Qwen3-MoE: num_local_experts)
    default_experts, default_top_k = 64, 8     # the config class's defaults (OLMoE's)
    expert_ffn_key = "intermediate_size"       # the config's name for each expert's width (Qwen3-MoE: moe_...)

    # -- reading -------------------------------------------------------------------------------------------
    def moe_fields(self, fields: dict[str, Any]) -> dict[str, Any]:
        """The MoE settings of a config, as ``ModelConfig.extra``."""
        implementation = fields.get("experts_implementation") or fields.get("_experts_implementation") or "grouped_mm"
        if implementation not in EXPERTS_IMPLEMENTATIONS:
            raise ValueError(f"experts_implementation {implementation!r} is not modelled (its tensors follow each "
                             f"expert's count, or a kernel's): expected one of {EXPERTS_IMPLEMENTATIONS}, "
                             "transformers' default")
        aliases = (self.experts_key, "num_local_experts" if self.experts_key == "num_experts" else "num_experts")
        experts = next((fields[key] for key in aliases if fields.get(key) is not None), self.default_experts)
        top_k = fields.get("num_experts_per_tok") or self.default_top_k
        if not experts or not top_k or top_k > experts:
            raise ValueError(f"{fields['model_type']}: {experts!r} experts and num_experts_per_tok={top_k!r}: expected "
                             "at least one expert and 1 <= num_experts_per_tok <= the experts")
        expert_ffn = fields.get(self.expert_ffn_key) or fields["intermediate_size"]
        return dict(experts=int(experts), top_k=int(top_k), expert_ffn=int(expert_ffn),
                    normalize=bool(self.always_renormalises or fields.get("norm_topk_prob", False)),
                    dense_layers=self.dense_layers(fields))

    def dense_layers(self, fields: dict[str, Any]) -> tuple[int, ...]:
        """Layers whose MLP is dense (none: Mixtral and OLMoE)."""
        return ()

    # -- checks --------------------------------------------------------------------------------------------
    def check_model(self, model: ModelConfig) -> None:
        extra = dict(model.extra)
        needed = {"experts", "top_k", "expert_ffn", "normalize", "dense_layers"}
        if set(extra) != needed:
            raise ValueError(f"{self.arch} reads its experts from ModelConfig.extra: expected exactly the keys "
                             f"{sorted(needed)}, got {sorted(extra)}")
        if not 1 <= extra["top_k"] <= extra["experts"] or extra["expert_ffn"] < 1:
            raise ValueError(f"{self.arch}: top_k {extra['top_k']} of {extra['experts']} experts of width "
                             f"{extra['expert_ffn']}: expected 1 <= top_k <= experts and a positive width")
        if any(not 0 <= i < model.num_layers for i in extra["dense_layers"]):
            raise ValueError(f"dense_layers {extra['dense_layers']} name layers outside 0..{model.num_layers - 1}")
        if model.activation is not None:
            raise ValueError(f"activation {model.activation!r}: {self.arch} has one MLP activation (expected None)")
        if model.dropout[0] or model.dropout[2]:
            raise ValueError(f"{self.arch} has attention dropout only: expected dropout[0] == dropout[2] == 0, got "
                             f"{model.dropout}")

    def check_setup(self, model: ModelConfig, setup: TrainingSetup) -> None:
        super().check_setup(model, setup)
        routed_counts(model, setup)                              # routing that does not fit is refused here

    def describe(self, model: ModelConfig, setup: TrainingSetup) -> str:
        routing = "balanced" if setup.routing in (None, "balanced") else "as given"
        return (f"{model.setting('experts')} experts, top-{model.setting('top_k')}, routing {routing}, "
                + super().describe(model, setup))

    # -- parameters ----------------------------------------------------------------------------------------
    def is_moe(self, model: ModelConfig, layer: int) -> bool:
        """Whether layer ``layer``'s MLP is the sparse MoE block."""
        return layer not in model.setting("dense_layers")

    def attention_parameters(self, model: ModelConfig) -> list[tuple]:
        """The attention's entries of ``block_parameters`` (Llama's q, k, v, o)."""
        return TransformersDecoder.block_parameters(self, model)[:4]

    def router_entries(self, model: ModelConfig) -> list[tuple]:
        """The MoE block's parameters in registration order: Mixtral and OLMoE make the router first."""
        return [self._router(model), *self._experts(model)]

    def _router(self, model: ModelConfig) -> tuple:
        return ("param", "mlp.gate.weight", (model.setting("experts"), model.d_model))

    def _experts(self, model: ModelConfig) -> list[tuple]:
        e, f, d = model.setting("experts"), model.setting("expert_ffn"), model.d_model
        return [("param", "mlp.experts.gate_up_proj", (e, 2 * f, d)), ("param", "mlp.experts.down_proj", (e, d, f))]

    def layer_parameters(self, model: ModelConfig, layer: int) -> list[tuple]:
        """Layer ``layer``'s parameters in ``parameters()`` order: ("linear", path, in, out, bias), ("norm", path,
        width) or ("param", name, shape)."""
        d, f = model.d_model, model.ffn
        if self.is_moe(model, layer):
            mlp = self.router_entries(model)
        else:
            mlp = [("linear", "mlp.gate_proj", d, f, False), ("linear", "mlp.up_proj", d, f, False),
                   ("linear", "mlp.down_proj", f, d, False)]
        return [*self.attention_parameters(model), *mlp, ("norm", "input_layernorm", d),
                ("norm", "post_attention_layernorm", d)]

    def block_parameters(self, model: ModelConfig) -> list[tuple]:
        """Every entry some layer has (a dense MLP's linears only where a layer is dense): what ``linears`` and
        ``lora_targets`` read."""
        entries: dict[str, tuple] = {}
        for layer in range(model.num_layers):
            for entry in self.layer_parameters(model, layer):
                entries.setdefault(entry[1], entry)
        return list(entries.values())

    def parameter_shapes(self, model: ModelConfig, setup: TrainingSetup) -> list[tuple[str, tuple[int, ...], bool]]:
        lora = setup.lora_rank > 0
        targets = self.lora_targets(model, setup)
        d, v = model.d_model, model.vocab_size
        out: list[tuple[str, tuple[int, ...], bool]] = [("model.embed_tokens.weight", (v, d), not lora)]
        for layer in range(model.num_layers):
            prefix = f"model.layers.{layer}."
            for entry in self.layer_parameters(model, layer):
                if entry[0] == "norm":
                    out.append((prefix + entry[1] + ".weight", (entry[2],), not lora))
                elif entry[0] == "param":
                    out.append((prefix + entry[1], entry[2], not lora))
                    if entry[1] == "mlp.experts.down_proj" and self.is_moe(model, layer):
                        out += self.expert_adapters(model, setup, prefix)
                else:
                    _, path, fan_in, fan_out, bias = entry
                    base = prefix + path + (".base_layer" if path in targets else "")
                    out.append((base + ".weight", (fan_out, fan_in), not lora))
                    if bias:
                        out.append((base + ".bias", (fan_out,), not lora))
                    if path in targets:
                        out.append((prefix + path + ".lora_A.default.weight", (setup.lora_rank, fan_in), True))
                        out.append((prefix + path + ".lora_B.default.weight", (fan_out, setup.lora_rank), True))
        out.append(("model.norm.weight", (d,), not lora))
        if not model.tied_embeddings:
            out.append(("lm_head.weight", (v, d), not lora))
        return out

    def expert_adapters(self, model: ModelConfig, setup: TrainingSetup, prefix: str) -> list[tuple]:
        """peft's ``ParamWrapper`` adapters of one layer's experts, after both stacked parameters (the wrapper of
        gate_up_proj inside the one of down_proj): lora_A (rank·E, in), lora_B (out, rank·E), float32."""
        e, f, d = model.setting("experts"), model.setting("expert_ffn"), model.d_model
        shapes = {"gate_up_proj": (d, 2 * f), "down_proj": (f, d)}            # (in, out) of each expert
        out = []
        for param, rank in self.adapted_experts(model, setup).items():
            fan_in, fan_out = shapes[param]
            out.append((f"{prefix}mlp.experts.{param}.lora_A.default.weight", (rank * e, fan_in), True))
            out.append((f"{prefix}mlp.experts.{param}.lora_B.default.weight", (fan_out, rank * e), True))
        return out

    def block_linear_weights(self, model: ModelConfig, setup: TrainingSetup) -> dict[str, tuple[int, int]]:
        """The ``nn.Linear`` weights of the blocks (a 4-bit loader's and FP8's): the attention's, and the dense MLPs';
        the router (applied with ``F.linear``) and the 3-D experts are not ``nn.Linear`` and stay 16-bit."""
        targets = self.lora_targets(model, setup)
        return {f"model.layers.{layer}.{entry[1]}{'.base_layer' if entry[1] in targets else ''}.weight":
                (entry[3], entry[2])
                for layer in range(model.num_layers) for entry in self.layer_parameters(model, layer)
                if entry[0] == "linear"}

    def peft_default_targets(self, model: ModelConfig) -> tuple[str, ...]:
        return ("q_proj", "v_proj")

    # peft 0.21 turns these target_modules names into LoRA on the experts' stacked parameters (its conversion of
    # transformers v4 names: ParamWrapper on gate_up_proj, with both halves' ranks, and on down_proj)
    expert_targets = {"gate_proj": "gate_up_proj", "up_proj": "gate_up_proj", "down_proj": "down_proj"}

    def lora_targets(self, model: ModelConfig, setup: TrainingSetup) -> set[str]:
        """The attention's Linear paths LoRA adapts, and ``mlp.experts.<name>`` for each peft target name that
        peft 0.21 turns into LoRA on the experts' stacked parameters (``adapted_experts``)."""
        if not setup.lora_rank:
            return set()
        attention = [entry[1] for entry in self.attention_parameters(model) if entry[0] == "linear"]
        if setup.lora_targets == "attention":
            return set(attention)
        if setup.lora_targets == "all":
            raise ValueError(f"lora_targets 'all' (peft's 'all-linear') on {model.name}: peft 0.21 adapts the router "
                             "('gate') and the experts' stacked parameters too, and LoRA on the router is not modelled: "
                             f"expected 'attention' or named targets, such as {self.example_targets()}")
        names = [t.rsplit(".", 1)[-1] for t in setup.lora_targets]
        known = {path.rsplit(".", 1)[1]: path for path in attention}
        unknown = [t for t in names if t not in known and t not in self.expert_targets]
        if "gate" in names:
            raise ValueError("LoRA on the router ('gate', a parameter peft 0.21 wraps) is not modelled: expected the "
                             f"attention's and the experts' names, such as {self.example_targets()}")
        if unknown:
            raise ValueError(f"LoRA target(s) {unknown} name no Linear layer or experts of a {model.name} block: "
                             f"expected names among {sorted(known) + sorted(self.expert_targets)}")
        fused: dict[str, set[str]] = {}
        for name, target in self.expert_targets.items():
            fused.setdefault(target, set()).add(name)
        for target, halves in fused.items():
            chosen = halves & set(names)
            if chosen and chosen != halves:
                raise ValueError(f"LoRA target(s) {sorted(chosen)} without {sorted(halves - chosen)}: peft 0.21 fuses "
                                 f"them into the experts' {target} and refuses one alone: expected both")
        experts = {f"mlp.experts.{name}" for name in names if name in self.expert_targets}
        if experts and setup.lora_dropout:
            raise ValueError("peft's LoRA on the experts' parameters (ParamWrapper) refuses lora_dropout: expected "
                             "lora_dropout=0 with expert targets")
        return {known[name] for name in names if name in known} | experts

    def example_targets(self) -> tuple[str, ...]:
        """Targets that adapt the attention and the experts (peft's names)."""
        return ("q_proj", "k_proj", "v_proj", "o_proj", *self.expert_targets)

    def adapted_experts(self, model: ModelConfig, setup: TrainingSetup) -> dict[str, int]:
        """The experts' stacked parameters peft's LoRA wraps, in their registration order, with each one's rank
        (``gate_up_proj``: twice the rank, its two halves' adapters fused)."""
        targets = {t.rsplit(".", 1)[-1] for t in self.lora_targets(model, setup) if t.startswith("mlp.experts.")}
        out = {}
        for param in ("gate_up_proj", "down_proj"):
            halves = [name for name, target in self.expert_targets.items() if target == param and name in targets]
            if halves:
                out[param] = setup.lora_rank * len(halves)
        return out

    def tensor_parallel_dim(self, name: str, shape: tuple[int, ...]) -> int | None:
        if name.endswith("mlp.gate.weight"):
            return None                                   # the router: whole on every rank
        if name.endswith("experts.gate_up_proj"):
            return 1                                      # (E, 2F, C): each expert's hidden units
        if name.endswith("experts.down_proj"):
            return 2                                      # (E, C, F)
        return super().tensor_parallel_dim(name, shape)

    def activation_design(self) -> str:
        return "moe"

    def layer_signature(self, model: ModelConfig, layer: int) -> Hashable:
        return (model.layer_type(layer), self.is_moe(model, layer))

    # -- the block -----------------------------------------------------------------------------------------
    def mlp(self, r: Any, prefix: str, n2: _T) -> _T:
        layer = int(prefix.split(".")[2])
        if not self.is_moe(r.model, layer):
            return super().mlp(r, prefix, n2)
        return self.sparse_moe_block(r, prefix, n2)

    def router(self, r: Any, prefix: str, hidden: _T) -> tuple[_T, _T, _T]:
        """``gate(hidden_states)``: (router_logits, router_scores, router_indices)."""
        model = r.model
        k, label = model.setting("top_k"), prefix + "mlp.gate"
        logits = r.linear(hidden, r.p(prefix + "mlp.gate.weight"), None, model.setting("experts"), label)
        probs = r.softmax(logits, label + " softmax")     # float32, whatever the logits' dtype (a copy first)
        values, indices = topk(r, probs, k, label)
        r.rel(probs)
        if model.setting("normalize"):
            values = renormalise(r, values, k, label)
        if self.router_casts_back and values.item != logits.item:
            scores = r.to_float(values, label + " weights .to(dtype)", "activations", logits.item)
            r.rel(values)
            values = scores
        return logits, values, indices

    def sparse_moe_block(self, r: Any, prefix: str, n2: _T) -> _T:
        """``SparseMoeBlock.forward``: the router, then ``grouped_mm_experts_forward``."""
        hidden = r.view(n2)                               # hidden_states.view(-1, C)
        logits, weights, indices = self.router(r, prefix, hidden)
        adapted = self.adapted_experts(r.model, r.setup)
        factors = {}
        for param in reversed(list(adapted)):             # peft's wrappers, the outermost (down_proj's) first
            factors[param] = self.lora_factors(r, prefix, param, adapted[param])
        out = self.grouped_experts(r, prefix, hidden, indices, weights, factors)
        for lhs, rhs in factors.values():                 # the wrappers exit: their proxies go
            r.rel(lhs, rhs)
        r.rel(logits, weights, indices, hidden)           # the block's locals, at its return
        return out

    def lora_factors(self, r: Any, prefix: str, param: str, rank: int) -> tuple[_T, _T]:
        """peft's ``ParamWrapper._activate_lora`` for one stacked parameter: ``get_delta_factors`` (lhs = lora_B
        viewed (E, out, rank), rhs = lora_A viewed (E, rank, in), each cast to the weight's dtype: copies of the
        float32 adapters in a bf16 model), then ``register_parametrization``, which evaluates the merged weight once
        to check its shape (allocated and freed)."""
        name = f"{prefix}mlp.experts.{param}"
        base = r.p(name)
        a, b = r.p(name + ".lora_A.default.weight"), r.p(name + ".lora_B.default.weight")
        rhs = r.view(a)                                   # reshape: its gradient is a view too
        n = r.node(f"ViewBackward {name} lora_B.reshape().permute()", [(b, "alloc")])   # the gradient is copied back
        lhs = r.output(r.view(b), n)
        if base.item != a.item:                           # .to(param.dtype)
            lhs_low = r.to_float(lhs, f"{name} lhs .to(dtype)", "activations", base.item)
            rhs_low = r.to_float(rhs, f"{name} rhs .to(dtype)", "activations", base.item)
            r.rel(lhs, rhs)
            lhs, rhs = lhs_low, rhs_low
        check = baddbmm(r, base, lhs, rhs, f"{name} parametrization check", grad=False)
        r.rel(check)
        return lhs, rhs

    def experts_weight(self, r: Any, prefix: str, param: str, factors: dict, merged: list) -> _T:
        """``self.gate_up_proj`` (or ``down_proj``) inside the experts' forward: the parameter, or, wrapped by peft,
        the merged weight its parametrization computes (cached until the outermost wrapper exits)."""
        name = f"{prefix}mlp.experts.{param}"
        if param not in factors:
            return r.p(name)
        weight = baddbmm(r, r.p(name), *factors[param], f"{name} merged (W + B @ A)")
        merged.append(weight)
        return weight

    def grouped_experts(self, r: Any, prefix: str, hidden: _T, indices: _T, weights: _T,
                        factors: dict | None = None) -> _T:
        """``grouped_mm_experts_forward`` (transformers' integrations/moe.py), allocation by allocation."""
        model = r.model
        k, f, d = model.setting("top_k"), model.setting("expert_ffn"), model.d_model
        label = prefix + "mlp.experts"
        pairs = r.setup.tokens * k
        experts = model.setting("experts")
        sorted_ids = r.new(pairs, 8, "temporaries", f"{label} expert ids sorted")      # torch.sort(expert_ids)
        perm = r.new(pairs, 8, "activations", f"{label} perm")
        tokens_of = r.new(pairs, 8, "activations", f"{label} perm // k")
        gathered = index(r, hidden, tokens_of, pairs, d, f"{label} hidden[perm // k]")
        r.rel(tokens_of)
        gathered_weights = index(r, weights, perm, pairs, 1, f"{label} weights[perm]")
        histc_input = r.new(pairs, 4, "temporaries", f"{label} expert ids .float()")   # .int() on CUDA: 4 bytes too
        per_expert = r.new(experts, 4, "temporaries", f"{label} histc")
        offsets = r.new(experts, 4, "activations", f"{label} offsets (int32)")
        factors, merged = factors or {}, []
        gate_up = grouped_mm(r, gathered, self.experts_weight(r, prefix, "gate_up_proj", factors, merged), offsets,
                              pairs, 2 * f,
                              f"{label} gate_up")
        gate, up = r.chunk2(gate_up, f"{label} gate_up.chunk(2)")
        act = r.unary(gate, "Silu", f"{label} act_fn", save_input=True)
        product = r.mul(act, up, f"{label} act * up")
        r.rel(act, gate, up, gate_up)
        down = grouped_mm(r, product, self.experts_weight(r, prefix, "down_proj", factors, merged), offsets, pairs,
                           d, f"{label} down")
        r.rel(product)
        weight_column = r.view(gathered_weights)          # .unsqueeze(-1)
        weighted = r.mul(down, weight_column, f"{label} * weights", numel=down.numel)
        r.rel(weight_column, down)
        inverse = r.new(pairs, 8, "activations", f"{label} inv_perm")
        arange = r.new(pairs, 8, "temporaries", f"{label} arange")
        r.rel(arange)                                     # inv_perm[perm] = arange(...): in place
        back = index(r, weighted, inverse, pairs, d, f"{label} weighted[inv_perm]")
        r.rel(weighted, inverse)
        n = r.node(f"SumBackward {label} .view(T, k, C).sum(1)", [(back, "alloc")])   # reshaping the expanded
        total = r.output(r.new(r.setup.tokens * d, back.item, "activations", f"{label} sum over k"), n)  # grad copies
        out = total
        if total.item != hidden.item:                     # .to(hidden_states.dtype)
            out = r.to_float(total, f"{label} .to(dtype)", "activations", hidden.item)
        r.rel(sorted_ids, histc_input, per_expert, back, gathered, gathered_weights, perm, offsets)
        if out is not total:
            r.rel(total)
        r.rel(*merged)                                    # parametrize's cache is cleared
        return out


def common_config(model: ModelConfig) -> dict[str, Any]:
    return dict(num_hidden_layers=model.num_layers, hidden_size=model.d_model, num_attention_heads=model.num_heads,
                num_key_value_heads=model.kv_heads, intermediate_size=model.ffn, vocab_size=model.vocab_size,
                max_position_embeddings=model.max_seq_len, tie_word_embeddings=model.tied_embeddings,
                use_cache=model.use_cache, attention_dropout=model.dropout[1],
                num_experts_per_tok=model.setting("top_k"))


