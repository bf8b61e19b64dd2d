"""What the reader describes: a transformer's shape (``ModelConfig``) and how it trains (``TrainingSetup``).

Both are frozen dataclasses of plain numbers and names (no torch): bytes per element are ints, dtypes are names.
What each design adds to ``ModelConfig`` is checked by its family (``families/``), found through ``registry.py``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..checks import positive_int
from . import registry

GPT2_ACTIVATIONS = ("gelu_new", "gelu_pytorch_tanh", "gelu")   # GPT-2's activation_function (None: gelu_new)
ATTENTIONS = ("sdpa", "eager")                 # transformers' attn_implementation
LOSSES = ("labels", "logits", "shifted-sum")   # model(..., labels=), F.cross_entropy on outputs.logits, notebook 17's
OUTPUTS = ("kept", "kept-in-step", "dropped")  # what the reader's loop does with the model's output object
PRECISIONS = ("fp32", "bf16-autocast", "bf16")
OPTIMIZERS = ("sgd", "sgd_momentum", "adam", "adamw", "adafactor", "adamw8bit")
OPTIMIZER_IMPLS = ("for-loop", "foreach", "fused")
CHECKPOINTING = ("none", "every_block", "selective")
LORA_TARGETS = ("all", "attention")
STRATEGIES = ("single", "ddp", "zero1", "zero2", "fsdp")
DEVICES = ("cuda", "cpu")
BASE_QUANTS = ("none", "nf4", "nf4-double")       # a frozen 4-bit base (QLoRA), with double quantisation or not
BF16_ROUNDINGS = ("nearest", "stochastic", "kahan")  # how pure bf16 AdamW writes its update (notebook 10)
KINDS = ("parameters", "gradients", "optimizer_state", "activations", "loss", "weight_copies", "comm_buffers",
         "inputs", "temporaries")
LAYER_TYPES = ("full_attention", "sliding_attention")   # transformers' config.layer_types


def _choice(name: str, value: Any, allowed: tuple[str, ...]) -> str:
    if value not in allowed:
        raise ValueError(f"{name} must be one of {allowed}, got {value!r}")
    return value


def _frozen(value: Any) -> Any:
    """A hashable copy: lists and tuples as tuples, dicts as sorted (key, value) tuples."""
    if isinstance(value, dict):
        return tuple(sorted((str(k), _frozen(v)) for k, v in value.items()))
    if isinstance(value, (list, tuple)):
        return tuple(_frozen(v) for v in value)
    return value


@dataclass(frozen=True)
class ModelConfig:
    """The shape of a decoder-only transformer, and which design (family) it is.

    The design is ``arch``, a family registered in ``registry.py`` (one module each under ``families/``):

    * the course's own designs: ``"gpt"`` (``utils.TinyTransformer``: learned positions, pre-norm LayerNorm with
      bias, a fused qkv Linear, a GELU MLP, biases everywhere, an untied head with bias) and ``"llama"``
      (``llama_like``: Llama written out in plain PyTorch: RMSNorm in float32, rotary embeddings, grouped-query
      attention, SwiGLU, no biases, the head tied or not);
    * transformers' models, as ``model_config_from_hf`` reads them from a config: ``"hf-llama"`` (Llama, Mistral,
      Qwen2), ``"hf-qwen3"``, ``"hf-phi3"``, ``"hf-gemma2"``, ``"hf-gemma3"`` (Gemma 3's text model),
      ``"hf-gpt2"``.

    Attributes:
        num_layers: transformer blocks.
        d_model: width of the residual stream.
        num_heads: query heads.
        vocab_size: tokens in the vocabulary (rows of the embedding and the head).
        ffn_width: hidden width of the MLP (None: ``4 * d_model``).
        num_kv_heads: key/value heads (None: ``num_heads``); must divide ``num_heads``.
        max_seq_len: longest sequence: the position table's rows for ``"gpt"`` and GPT-2; the published context
            length otherwise.
        arch: the design, a registered family (above).
        tied_embeddings: the head shares the embedding's weight.
        name: a label for tables.
        head_width: a head width other than ``d_model / num_heads`` (config ``head_dim``).
        qkv_bias, out_bias, mlp_bias: biases of the q/k/v, output and MLP projections (Qwen2: q/k/v).
        attention: transformers' ``attn_implementation``, ``"sdpa"`` or ``"eager"``.
        sliding_window: the window of the layers that slide (Mistral: every layer; ``layer_types`` says which).
        use_cache: ``config.use_cache``: a model in training mode without checkpointing fills a ``DynamicCache``
            with a copy of every layer's keys and values during forward.
        dropout: three probabilities, (embedding, attention, residual): GPT-2's ``embd_pdrop``, ``attn_pdrop``,
            ``resid_pdrop``; Phi-3's ``attention_dropout`` and ``resid_pdrop``; the others' ``attention_dropout``.
            Each > 0 keeps a noise tensor per dropout in training; attention dropout sends sdpa to its math kernel
            on the CPU.
        activation: the MLP's activation where a family has several (GPT-2's ``activation_function``, None:
            ``"gelu_new"``).
        layer_types: per layer, ``"full_attention"`` or ``"sliding_attention"`` (transformers' ``layer_types``, as
            its config computes them: Qwen2 and Qwen3 from ``use_sliding_window`` and ``max_window_layers``, Gemma
            2 alternating, Gemma 3 five sliding to one full); None: every layer the same.
        extra: what one family alone reads, as sorted (name, value) pairs (Gemma's soft-capping); the family
            checks it.

    Raises:
        ValueError: non-positive sizes, heads that do not divide the width, key/value heads that do not divide
            the heads, an unknown ``arch``, or a field the design does not have (the family names it).

    Example:
        >>> gpt2_small = ModelConfig(num_layers=12, d_model=768, num_heads=12, vocab_size=50257, max_seq_len=1024)
        >>> count_parameters(gpt2_small)          # GPT-2 small's shape, with an untied head
    """

    num_layers: int
    d_model: int
    num_heads: int
    vocab_size: int
    ffn_width: int | None = None
    num_kv_heads: int | None = None
    max_seq_len: int = 2048
    arch: str = "gpt"
    tied_embeddings: bool = False
    name: str = "custom"
    head_width: int | None = None
    qkv_bias: bool = False
    out_bias: bool = False
    mlp_bias: bool = False
    attention: str = "sdpa"
    sliding_window: int | None = None
    use_cache: bool = True
    dropout: tuple[float, float, float] = (0.0, 0.0, 0.0)
    activation: str | None = None
    layer_types: tuple[str, ...] | None = None
    extra: tuple[tuple[str, Any], ...] = ()

    def __post_init__(self) -> None:
        for name in ("num_layers", "d_model", "num_heads", "vocab_size", "max_seq_len"):
            positive_int(name, getattr(self, name))
        family = registry.family_of(self.arch)
        _choice("attention", self.attention, ATTENTIONS)
        if isinstance(self.dropout, list):
            object.__setattr__(self, "dropout", tuple(self.dropout))
        if (not isinstance(self.dropout, tuple) or len(self.dropout) != 3
                or not all(isinstance(p, (int, float)) and not isinstance(p, bool) and 0 <= p < 1
                           for p in self.dropout)):
            raise ValueError(f"dropout must be three probabilities in [0, 1) (embedding, attention, residual), got "
                             f"{self.dropout!r}")
        for name in ("head_width", "sliding_window", "ffn_width", "num_kv_heads"):
            if getattr(self, name) is not None:
                positive_int(name, getattr(self, name))
        if self.layer_types is not None:
            object.__setattr__(self, "layer_types", tuple(self.layer_types))
            if len(self.layer_types) != self.num_layers or not set(self.layer_types) <= set(LAYER_TYPES):
                raise ValueError(f"layer_types must name each of the {self.num_layers} layers, one of {LAYER_TYPES}, "
                                 f"got {self.layer_types!r}")
            if "sliding_attention" in self.layer_types and self.sliding_window is None:
                raise ValueError("layer_types has sliding layers: expected a sliding_window")
        object.__setattr__(self, "extra", _frozen(dict(self.extra)))
        if self.d_model % self.num_heads and self.head_width is None:
            raise ValueError(f"num_heads ({self.num_heads}) must divide d_model ({self.d_model}): expected a head "
                             f"count such as {_divisors_near(self.d_model, self.num_heads)}")
        if self.kv_heads > self.num_heads or self.num_heads % self.kv_heads:
            raise ValueError(f"num_kv_heads ({self.kv_heads}) must divide num_heads ({self.num_heads}): each key/value "
                             "head serves a whole group of query heads")
        if not isinstance(self.name, str) or not self.name:
            raise ValueError(f"name must be a non-empty string, got {self.name!r}")
        family.check_model(self)

    @property
    def ffn(self) -> int:
        """The MLP's hidden width."""
        return self.ffn_width if self.ffn_width is not None else 4 * self.d_model

    @property
    def kv_heads(self) -> int:
        """Key/value heads."""
        return self.num_kv_heads if self.num_kv_heads is not None else self.num_heads

    @property
    def head_dim(self) -> int:
        """Width of one attention head."""
        return self.head_width if self.head_width is not None else self.d_model // self.num_heads

    @property
    def is_hf(self) -> bool:
        """A transformers model (``model_config_from_hf``), not one of the course's own designs."""
        return bool(registry.family_of(self.arch).model_types)

    def setting(self, name: str, default: Any = None) -> Any:
        """A family's own setting from ``extra`` (``default`` when absent)."""
        return dict(self.extra).get(name, default)

    def layer_type(self, layer: int) -> str:
        """``"full_attention"`` or ``"sliding_attention"`` for layer ``layer`` (every layer slides when a window is
        set without ``layer_types``, as Mistral's)."""
        if self.layer_types is not None:
            return self.layer_types[layer]
        return "sliding_attention" if self.sliding_window is not None else "full_attention"


def _divisors_near(width: int, heads: int) -> str:
    near = sorted((d for d in range(1, min(width, 4 * heads) + 1) if width % d == 0), key=lambda d: abs(d - heads))
    return " or ".join(str(d) for d in sorted(near[:3]))


def _routing(value: Any) -> Any:
    """``TrainingSetup.routing`` checked and made hashable: None, ``"balanced"``, or tokens per expert (a tuple of ints
    >= 0, or one such tuple per MoE layer)."""
    if value is None or value == "balanced":
        return value
    counts = _frozen(value) if isinstance(value, (list, tuple)) else None
    flat = counts and all(isinstance(n, int) and not isinstance(n, bool) and n >= 0 for n in counts)
    nested = counts and all(isinstance(layer, tuple) and layer and all(
        isinstance(n, int) and not isinstance(n, bool) and n >= 0 for n in layer) for layer in counts)
    if not (flat or nested):
        raise ValueError(f"routing must be None, 'balanced', tokens per expert (ints >= 0) or one such list per MoE "
                         f"layer, got {value!r}")
    return counts


@dataclass(frozen=True)
class TrainingSetup:
    """How the model is trained: one optimizer step of ``accumulation_steps`` micro-batches per device.

    Attributes:
        micro_batch: sequences per micro-batch per device.
        seq_len: tokens per sequence.
        precision: ``"fp32"``; ``"bf16-autocast"`` (fp32 weights, which are the master weights, and fp32
            gradients and optimizer state; matmuls and their saved activations in bf16 under
            ``torch.autocast``, which caches a bf16 copy of each trainable weight during forward);
            ``"bf16"`` (pure bf16: the model, its gradients and torch.optim's state in bf16, the loss
            computed on ``logits.float()``).
        optimizer: ``"sgd"``, ``"sgd_momentum"``, ``"adam"``, ``"adamw"``, ``"adafactor"``
            (``torch.optim.Adafactor``), ``"adamw8bit"`` (``utils.AdamW8bit`` of notebook 09).
        optimizer_impl: torch.optim's implementation: ``"foreach"`` (CUDA's default: a temporary the
            size of all parameters of a group), ``"for-loop"`` (the CPU's default: temporaries of one
            or two tensors at a time), ``"fused"`` (none; SGD, Adam and AdamW only).
        checkpointing: ``"none"``, ``"every_block"`` (each block under non-reentrant
            ``torch.utils.checkpoint``), ``"selective"`` (notebook 03's policy: matmul outputs saved,
            everything else recomputed).
        lora_rank: 0 trains every parameter; r > 0 freezes the model and trains LoRA adapters of rank r
            (A: r x in, B: out x r, scale alpha / r) on ``lora_targets``.
        lora_targets: ``"all"`` (every Linear inside the blocks) or ``"attention"`` (the attention
            projections only); for transformers' designs also a tuple of module names, as peft's
            ``LoraConfig(target_modules=...)`` (``("q_proj", "v_proj")``).
        lora_dropout: peft's ``lora_dropout`` (transformers' designs; 0 makes it an ``nn.Identity``).
        padded: transformers' designs: the batch comes with an ``attention_mask`` that pads some
            sequences (the 4-D mask is then built and kept; without padding sdpa runs ``is_causal``).
        loss: transformers' designs: ``"labels"`` (``model(input_ids, labels=...).loss``, the model's
            shifted loss), ``"logits"`` (your own ``F.cross_entropy`` on ``outputs.logits.float()``) or
            ``"shifted-sum"`` (notebook 17's ``train_step``: the targets counted first, then
            ``F.cross_entropy(logits[:, :-1].flatten(0, -2), labels[:, 1:].flatten(), reduction="sum") / count``
            and a running total of the loss).
        chunked_loss: 0 computes ``F.cross_entropy`` on the whole logits; c > 0 uses
            ``utils.chunked_cross_entropy`` with c tokens per chunk (notebook 08).
        accumulation_steps: micro-batches per optimizer step (notebook 02).
        strategy: ``"single"`` (one device), ``"ddp"``, ``"zero1"``, ``"zero2"``, ``"fsdp"`` (ZeRO-3,
            FSDP2's ``fully_shard`` per block).
        ranks: data-parallel ranks (1 for ``"single"``, at least 2 otherwise).
        device: ``"cuda"`` or ``"cpu"``: the few op-level details that differ (pure bf16 LayerNorm
            statistics are bf16 on the CPU, fp32 on CUDA).
        base_quant: fewer bits (notebook 10; ``calculator/fewer_bits.py`` says what is replayed): ``"none"``;
            ``"nf4"`` or ``"nf4-double"``: every Linear weight of the blocks stored in 4-bit NF4 with an fp32
            absmax per ``quant_block`` elements (``"nf4-double"``: the absmaxes in int8, one fp32 scale per 256
            of them), frozen under LoRA (QLoRA: needs ``lora_rank > 0`` and ``precision="bf16"``).
        quant_block: NF4's block (even, > 0, dividing every weight; QLoRA's 64).
        kbit_prepared: peft's ``prepare_model_for_kbit_training`` ran first: every non-4-bit parameter of the
            bf16 model (embeddings, head, norms, biases) upcast to fp32 (needs a 4-bit base).
        bf16_rounding: pure bf16 AdamW (``precision="bf16"``, full fine-tuning): ``"nearest"`` is
            torch.optim's; ``"stochastic"`` and ``"kahan"`` are ``utils.lowbit.AdamWBF16`` (notebook 10's
            update: bf16 moments, a Python-int step count; ``"kahan"`` adds a bf16 compensation buffer), with
            ``optimizer="adamw"`` and ``optimizer_impl="for-loop"``.
        fp8: dynamic FP8 training of the blocks' Linear layers (torchao's float8 recipe, tensorwise): the
            model state of ``precision`` (``"bf16-autocast"`` or ``"bf16"``), one-byte copies per matmul.
        outputs: what the reader's loop does with the model's output object (transformers' designs; it holds the
            logits, and the cache without checkpointing): ``"kept"``, the loop of most tutorials and the Hugging
            Face course (``outputs = model(**batch)``, ``loss = outputs.loss``, or ``logits = model(x).logits``,
            in the training loop): the variable keeps the last outputs alive through backward, the optimizer step
            and the next forward, until that forward returns and replaces them; ``"kept-in-step"``: the same lines
            inside a step function, whose return drops them after ``optimizer.zero_grad()``; ``"dropped"``: the
            output object goes before backward (``loss = model(**batch).loss``, the Trainer's ``compute_loss``).
            None: each design's own loop: ``"kept"`` for transformers' models with ``loss="labels"`` or
            ``"logits"``, ``"dropped"`` for notebook 17's ``"shifted-sum"`` (it computes its loss inline) and the
            course's designs (``reference_step`` does too).
        reentrant: with ``checkpointing="every_block"``: ``use_reentrant=True`` (transformers'
            ``gradient_checkpointing_kwargs={"use_reentrant": True}``): each block's forward runs without autograd,
            and its backward recomputes the whole block, output included, then runs a backward of its own.
        optimizer_options: the keyword arguments given to the optimizer's constructor (a dict, kept as sorted
            pairs): what changes memory is replayed or refused, the rest (``lr``, ``betas``, ...) is read and
            needs nothing (``optimizers.OPTIMIZER_OPTIONS`` says which is which).
        routing: a mixture of experts' routing (notebook 14; refused for a dense model): None or ``"balanced"``
            (every expert receives ``T·k / E`` of a micro-batch's ``T·k`` (token, slot) pairs), or the tokens per
            expert that the router chose, one tuple of ``E`` counts per MoE layer (or one tuple for every layer),
            each summing to ``micro_batch · seq_len · k``: the same in every micro-batch. The MoE family checks it.

    Raises:
        ValueError: an unknown choice, a non-positive size, a strategy that needs more ranks than
            given, a ``"fused"`` optimizer torch does not fuse.

    Example:
        >>> TrainingSetup(micro_batch=4, seq_len=2048, checkpointing="every_block", lora_rank=16)
        >>> TrainingSetup(seq_len=4096, strategy="fsdp", ranks=64, optimizer_impl="fused")
    """

    micro_batch: int = 1
    seq_len: int = 2048
    precision: str = "bf16-autocast"
    optimizer: str = "adamw"
    optimizer_impl: str = "foreach"
    checkpointing: str = "none"
    lora_rank: int = 0
    lora_targets: str | tuple[str, ...] = "all"
    chunked_loss: int = 0
    accumulation_steps: int = 1
    strategy: str = "single"
    ranks: int = 1
    device: str = "cuda"
    lora_dropout: float = 0.0
    padded: bool = False
    loss: str = "labels"
    base_quant: str = "none"
    quant_block: int = 64
    kbit_prepared: bool = False
    bf16_rounding: str = "nearest"
    fp8: bool = False
    outputs: str | None = None
    reentrant: bool = False
    optimizer_options: tuple[tuple[str, Any], ...] = ()
    routing: Any = None

    def __post_init__(self) -> None:
        positive_int("micro_batch", self.micro_batch, "sequences per device")
        positive_int("seq_len", self.seq_len, "tokens per sequence")
        positive_int("accumulation_steps", self.accumulation_steps)
        positive_int("ranks", self.ranks)
        for name, allowed in [("precision", PRECISIONS), ("optimizer", OPTIMIZERS), ("optimizer_impl", OPTIMIZER_IMPLS),
                              ("checkpointing", CHECKPOINTING), ("strategy", STRATEGIES), ("device", DEVICES),
                              ("loss", LOSSES), ("base_quant", BASE_QUANTS), ("bf16_rounding", BF16_ROUNDINGS)]:
            _choice(name, getattr(self, name), allowed)
        if isinstance(self.lora_targets, tuple):
            if not self.lora_targets or not all(isinstance(n, str) and n for n in self.lora_targets):
                raise ValueError(f"lora_targets as a tuple names modules, as peft's target_modules: expected "
                                 f"non-empty strings such as ('q_proj', 'v_proj'), got {self.lora_targets!r}")
        else:
            _choice("lora_targets", self.lora_targets, LORA_TARGETS)
        if isinstance(self.lora_dropout, bool) or not isinstance(self.lora_dropout, (int, float)) \
                or not 0 <= self.lora_dropout < 1:
            raise ValueError(f"lora_dropout must be a probability in [0, 1), got {self.lora_dropout!r}")
        if not isinstance(self.padded, bool):
            raise ValueError(f"padded must be True or False, got {self.padded!r}")
        for name in ("lora_rank", "chunked_loss"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"{name} must be an int >= 0 (0 turns it off), got {value!r}")
        if self.strategy == "single" and self.ranks != 1:
            raise ValueError(f"strategy 'single' trains on one device: expected ranks=1, got {self.ranks} (pick 'ddp', "
                             "'zero1', 'zero2' or 'fsdp' for several)")
        if self.strategy != "single" and self.ranks < 2:
            raise ValueError(f"strategy {self.strategy!r} needs at least 2 ranks to replicate or shard over, got "
                             f"ranks={self.ranks} (use strategy 'single' for one device)")
        if self.optimizer_impl == "fused" and self.optimizer not in ("sgd", "sgd_momentum", "adam", "adamw"):
            raise ValueError(f"torch.optim has no fused {self.optimizer!r}: expected optimizer_impl 'for-loop' or "
                             "'foreach' (fused exists for sgd, sgd_momentum, adam, adamw)")
        self._check_fewer_bits()
        if self.outputs is not None:
            _choice("outputs", self.outputs, OUTPUTS)
        if not isinstance(self.reentrant, bool):
            raise ValueError(f"reentrant must be True or False, got {self.reentrant!r}")
        if self.reentrant and self.checkpointing != "every_block":
            raise ValueError(f"reentrant=True is use_reentrant=True of torch.utils.checkpoint: expected checkpointing "
                             f"'every_block' with it, got {self.checkpointing!r}")
        options = self.optimizer_options
        if isinstance(options, dict) or (isinstance(options, tuple) and all(
                isinstance(pair, tuple) and len(pair) == 2 and isinstance(pair[0], str) for pair in options)):
            object.__setattr__(self, "optimizer_options", _frozen(dict(options)))
        else:
            raise ValueError(f"optimizer_options must be a dict of the optimizer's keyword arguments, got {options!r}")
        object.__setattr__(self, "routing", _routing(self.routing))
        if self.optimizer == "adamw8bit" and self.optimizer_impl != "for-loop":
            raise ValueError("utils.AdamW8bit updates one tensor at a time: expected optimizer_impl 'for-loop' "
                             f"with optimizer 'adamw8bit', got {self.optimizer_impl!r}")

    def _check_fewer_bits(self) -> None:
        """Notebook 10's options: each combination that means nothing is refused, saying what is expected."""
        for name in ("kbit_prepared", "fp8"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be True or False, got {getattr(self, name)!r}")
        block = self.quant_block
        if isinstance(block, bool) or not isinstance(block, int) or block <= 0 or block % 2:
            raise ValueError(f"quant_block must be a positive even int (elements per NF4 absmax; QLoRA's 64), got "
                             f"{block!r}")
        if self.base_quant == "none":
            if block != 64:
                raise ValueError(f"quant_block {block} sets NF4's block: expected base_quant 'nf4' or 'nf4-double' "
                                 "with it")
            if self.kbit_prepared:
                raise ValueError("kbit_prepared models prepare_model_for_kbit_training on a 4-bit model: expected "
                                 "base_quant 'nf4' or 'nf4-double' with it")
        else:
            if not self.lora_rank:
                raise ValueError(f"base_quant {self.base_quant!r} stores a frozen base, and a frozen model with "
                                 "nothing else trains nothing: expected lora_rank > 0 (QLoRA)")
            if self.precision != "bf16":
                raise ValueError(f"base_quant {self.base_quant!r} dequantises to bf16 around a bf16 model (QLoRA's "
                                 f"compute dtype): expected precision 'bf16', got {self.precision!r}")
            if self.strategy not in ("single", "ddp"):
                raise ValueError(f"a 4-bit base is modelled on one device or under DDP: expected strategy 'single' "
                                 f"or 'ddp', got {self.strategy!r}")
            if self.fp8:
                raise ValueError("fp8 and a 4-bit base are separate recipes: expected fp8=False with base_quant "
                                 f"{self.base_quant!r}")
        if self.bf16_rounding != "nearest":
            wanted = {"precision": "bf16", "optimizer": "adamw", "optimizer_impl": "for-loop", "lora_rank": 0}
            wrong = {k: getattr(self, k) for k, v in wanted.items() if getattr(self, k) != v}
            if wrong:
                raise ValueError(f"bf16_rounding {self.bf16_rounding!r} is pure bf16 AdamW on every parameter "
                                 f"(utils.lowbit.AdamWBF16, one tensor at a time): expected {wanted}, got {wrong}")
            if self.strategy not in ("single", "ddp"):
                raise ValueError(f"bf16_rounding {self.bf16_rounding!r} is modelled on one device or under DDP: "
                                 f"expected strategy 'single' or 'ddp', got {self.strategy!r}")
        if self.fp8 and self.precision == "fp32":
            raise ValueError("FP8 training casts from bf16 matmuls: expected precision 'bf16-autocast' (fp32 master "
                             "weights) or 'bf16' with fp8=True, got 'fp32'")

    @property
    def tokens(self) -> int:
        """Tokens per micro-batch per device."""
        return self.micro_batch * self.seq_len

    def option(self, name: str, default: Any = None) -> Any:
        """One of ``optimizer_options`` (``default`` when not given)."""
        return dict(self.optimizer_options).get(name, default)
