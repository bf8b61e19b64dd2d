"""Fewer bits (notebook 10): a 4-bit NF4 base under LoRA, peft's upcast, pure bf16 with stochastic rounding or Kahan, FP8.

(Named apart from ``utils/lowbit.py``, the instruments notebook 10 measures with; this is what the calculator
replays of them. Pure bf16 AdamW's update itself is replayed with the other optimizers, in ``optimizers.py``.)

The options are ``TrainingSetup`` fields (``base_quant``, ``quant_block``, ``kbit_prepared``, ``bf16_rounding``,
``fp8``); ``predict`` replays their step with ``_LowBitStep``, the ordinary step whose parameters and Linear
layers this module changes. What each one changes, and how far the replay goes:

* ``base_quant="nf4"`` / ``"nf4-double"`` (QLoRA; LoRA and ``precision="bf16"`` required): every Linear weight
  inside the blocks is stored in NF4, as notebook 10 stores it (``utils.lowbit.nf4_storage_bytes``): two 4-bit
  codes per byte and an fp32 absmax per block of ``quant_block`` elements, or, with double quantisation, int8
  absmaxes with one fp32 scale per 256 of them and one fp32 offset. bitsandbytes keeps the same bytes plus its
  code tables (64 bytes per weight, and 1 KiB shared). Exact, measured to the byte. Replayed: each 4-bit
  matmul as bitsandbytes' ``MatMul4Bit`` runs it: ``dequantize_4bit`` writes the weight in bf16 (after an fp32
  copy of the absmaxes with double quantisation), the matmul reads it, and it is freed; autograd keeps the
  packed weight (a parameter: no new bytes) and the input, as ``F.linear`` would; backward dequantises again
  for the input's gradient. Those temporaries are modelled from bitsandbytes' source, not measured here
  (bitsandbytes does not run on this CPU): every other term of the step is the bf16 LoRA step's replay.
* ``kbit_prepared=True`` (peft's ``prepare_model_for_kbit_training``): every floating parameter that is not a
  4-bit one (embeddings, head, norms, biases) is cast from bf16 to fp32: 2 bytes more per element, exact,
  measured on a transformers Llama. **Not replayed**: what the upcast does to activations (fp32 embeddings
  and norm outputs, fp32 logits; bitsandbytes' ``Linear4bit`` casts each input back to bf16); the replay keeps
  the unprepared step's activations, and ``MemoryBreakdown.notes`` says so.
* ``bf16_rounding="stochastic"`` / ``"kahan"`` (pure bf16 full fine-tuning, AdamW): notebook 10's update,
  ``utils.lowbit.AdamWBF16``: the weight, its gradient and both moments in bf16, 8 bytes per parameter, plus a
  bf16 Kahan buffer, 10; the step count is a Python int (no tensor). Replayed whole, the optimizer's fp32
  temporaries included, and measured to the byte on the CPU.
* ``fp8=True`` (dynamic FP8 training, torchao's float8 recipe, tensorwise scales): the model state is the
  precision's own (bf16 or fp32 weights, gradients and optimizer state; nothing is stored in FP8), exact.
  Replayed: every Linear of the blocks (the head stays 16-bit, as torchtitan filters it) casts its input and
  weight to one-byte copies with an fp32 scale each while its matmul runs, keeps the 16-bit input for backward
  (torchao's default), and in backward casts the incoming gradient (e5m2) and the weight, then the gradient and
  the input, for the two gradient matmuls; under ``bf16-autocast`` the weight goes to FP8 without autocast's
  bf16 copy. Those copies are modelled from notebook 10's measurement of one layer and torchao's design; the
  step is not measured against torchao (no FP8 matmul on a CPU).
"""

from __future__ import annotations

from . import registry
from .config import ModelConfig, TrainingSetup
from .replay import _Node, _Replay, _T
from .step import _Step

NF4_SCALE_BLOCK = 256                      # absmaxes per fp32 scale of the second quantisation (QLoRA's 256)


def lowbit_on(setup: TrainingSetup) -> bool:
    """Whether any of this module's options is set."""
    return (setup.base_quant != "none" or setup.kbit_prepared or setup.bf16_rounding != "nearest"
            or setup.fp8)


def block_linear_weights(model: ModelConfig, setup: TrainingSetup) -> dict[str, tuple[int, int]]:
    """Every Linear weight inside the blocks: parameter name -> (out_features, in_features) (the family's).

    These are what a 4-bit loader quantises (``load_in_4bit`` skips only the head) and what FP8 recipes convert.
    """
    return registry.family_of(model.arch).block_linear_weights(model, setup)


def nf4_storage_bytes(numel: int, block_size: int = 64, double_quant: bool = True,
                      scale_block_size: int = NF4_SCALE_BLOCK) -> int:
    """Bytes of a weight in NF4 as notebook 10 stores it (``utils.lowbit.nf4_storage_bytes`` without torch): two
    4-bit codes per byte, an fp32 absmax per block, or, double-quantised, int8 absmaxes with an fp32 scale per
    ``scale_block_size`` of them and one fp32 offset."""
    blocks = numel // block_size
    if not double_quant:
        return numel // 2 + 4 * blocks
    return numel // 2 + blocks + 4 * -(-blocks // scale_block_size) + 4


def check_lowbit(model: ModelConfig, setup: TrainingSetup) -> None:
    """What needs the model: NF4's block size must divide every quantised weight.

    Raises:
        ValueError: a ``quant_block`` that does not divide a weight (the message names it and the sizes that do).
    """
    if setup.base_quant == "none" and not setup.fp8:
        return
    weights = block_linear_weights(model, setup)      # a design without them refuses here
    if setup.base_quant == "none":
        return
    for name, (fan_out, fan_in) in weights.items():
        if (fan_out * fan_in) % setup.quant_block:
            fits = [b for b in (32, 64, 128, 256) if (fan_out * fan_in) % b == 0]
            raise ValueError(f"quant_block {setup.quant_block} does not divide {name} ({fan_out} x {fan_in} "
                             f"elements): expected a block size that divides every Linear weight, such as {fits}")


def parameter_bytes(model: ModelConfig, setup: TrainingSetup) -> dict[str, int]:
    """Bytes of each parameter whose storage the options change (NF4 weights; fp32 after peft's upcast)."""
    out: dict[str, int] = {}
    nf4 = block_linear_weights(model, setup) if setup.base_quant != "none" else {}
    for name, (fan_out, fan_in) in nf4.items():
        out[name] = nf4_storage_bytes(fan_out * fan_in, setup.quant_block, setup.base_quant == "nf4-double",
                                      NF4_SCALE_BLOCK)
    if setup.kbit_prepared:
        for name, shape, trainable in registry.family_of(model.arch).parameter_shapes(model, setup):
            if name not in out and not trainable:
                numel = 1
                for size in shape:
                    numel *= size
                out[name] = 4 * numel                  # param.data = param.data.to(torch.float32)
    return out


def lowbit_notes(setup: TrainingSetup) -> tuple[str, ...]:
    """What the replay of these options models without measuring, or does not replay (for ``MemoryBreakdown``)."""
    notes = []
    if setup.base_quant != "none":
        notes.append("NF4: the dequantised bf16 weight of each 4-bit matmul (forward and backward) is modelled "
                     "from bitsandbytes' MatMul4Bit, not measured")
    if setup.kbit_prepared:
        notes.append("prepare_model_for_kbit_training: its fp32 parameters are counted; the fp32 activations "
                     "they cause (embeddings, norm outputs, logits) are not replayed")
    if setup.fp8:
        notes.append("FP8: the one-byte copies of each block Linear's input, weight and gradient are modelled "
                     "from notebook 10 and torchao's design, not measured against torchao")
    return tuple(notes)


class _LowBit(_Replay):
    """Mixin of ``_Step``: NF4 parameters and matmuls, fp32-upcast parameters, FP8 matmuls."""

    def lowbit_setup(self) -> None:
        model, setup = self.model, self.setup
        self.lowbit_bytes = parameter_bytes(model, setup)
        self.nf4_names = set(block_linear_weights(model, setup)) if setup.base_quant != "none" else set()
        self.fp8_names = set(block_linear_weights(model, setup)) if setup.fp8 else set()

    def param(self, leaf):  # noqa: ANN001, ANN201 - the engine's types
        if leaf.tensor is None and leaf.name in self.lowbit_bytes:
            buf = self._alloc(self.lowbit_bytes[leaf.name], "parameters", leaf.name)
            self.incref(buf)
            leaf.tensor = _T(buf, leaf.numel, leaf.item, leaf.trainable, None, 0, leaf)
        return super().param(leaf)

    def linear(self, x: _T, w: _T, b: _T | None, out_features: int, label: str) -> _T:
        name = w.leaf.name if w.leaf is not None else ""
        if name in self.nf4_names:
            return self.nf4_linear(x, w, b, out_features, label)
        if name in self.fp8_names:
            return self.fp8_linear(x, w, b, out_features, label)
        return super().linear(x, w, b, out_features, label)

    def dequantize_4bit(self, w: _T, label: str) -> _T:
        """bitsandbytes' ``dequantize_4bit``: an fp32 copy of the absmaxes (double quantisation), the bf16 weight."""
        absmax = None
        if self.setup.base_quant == "nf4-double":
            absmax = self.new(w.numel // self.setup.quant_block, 4, "temporaries", f"{label} absmax (fp32)")
        weight = self.new(w.numel, 2, "temporaries", f"{label} dequantised weight (bf16)")
        self.rel(absmax)
        return weight

    def nf4_linear(self, x: _T, w: _T, b: _T | None, out_features: int, label: str) -> _T:
        """``bnb.matmul_4bit``: ``F.linear(x, dequantize_4bit(W).t(), bias)``; keeps the packed W, not the copy."""
        rows = x.numel // (w.numel // out_features)
        weight = self.dequantize_4bit(w, label)
        inputs = [(x, "alloc")] + ([(b, "pass")] if b is not None else [])
        n = self.node(f"MatMul4Bit {label}", inputs)          # saves the packed weight: a parameter, nothing new
        out = self.output(self.sac_output(rows * out_features, x.item, "activations", label), n)
        self.rel(weight)
        if n is not None:
            def backward(r: _Replay, node: _Node, incoming: list) -> list:
                grads: list = [None] * len(node.edges)
                if x.rg:                                      # grad_output @ dequantize_4bit(W)
                    copy = r.dequantize_4bit(w, label)
                    grads[0] = r.new(x.numel, x.item, r._grad_kind(x), f"grad {label}")
                    r.rel(copy)
                return grads
            n.custom = backward
        return out

    def fp8_linear(self, x: _T, w: _T, b: _T | None, out_features: int, label: str) -> _T:
        """torchao's dynamic float8 Linear (tensorwise): one-byte copies of x and W while the matmul runs."""
        rows = x.numel // (w.numel // out_features)
        xc = self.cast16(x, f"{label} input bf16") if self.autocast else self.view(x)
        bc = (self.cast16(b, f"{label}.bias bf16") if self.autocast else self.view(b)) if b is not None else None
        wv = self.view(w)
        saved = ([xc] if wv.rg else []) + ([wv] if xc.rg else [])      # the 16-bit input and weight
        inputs = [(xc, "alloc"), (wv, "alloc")] + ([(bc, "pass")] if bc is not None else [])
        n = self.node(f"Float8Linear {label}", inputs, saved=saved)
        copies = self.fp8_copies([(xc.numel, "input e4m3"), (w.numel, "weight e4m3")], label)
        out = self.output(self.sac_output(rows * out_features, 2 if self.autocast else xc.item, "activations",
                                          label), n)
        self.rel(*copies)
        self.rel(*[t for t in (xc, bc, wv) if t is not None])
        if n is not None:
            def backward(r: _Replay, node: _Node, incoming: list) -> list:
                g = incoming[0]
                grads: list = [None] * len(node.edges)
                if bc is not None and bc.rg:
                    grads[2] = r.view(g)
                if xc.rg:                                     # grad_input = g8 @ w8
                    copies = r.fp8_copies([(g.numel, "grad e5m2"), (w.numel, "weight e4m3")], label)
                    grads[0] = r.new(xc.numel, xc.item, r._grad_kind(xc), f"grad {label}")
                    r.rel(*copies)
                if wv.rg:                                     # grad_weight = g8.T @ x8
                    copies = r.fp8_copies([(g.numel, "grad e5m2"), (xc.numel, "input e4m3")], label)
                    grads[1] = r.new(w.numel, w.item, r._grad_kind(wv), f"grad {label}")
                    r.rel(*copies)
                return grads
            n.custom = backward
        return out

    def fp8_copies(self, tensors: list[tuple[int, str]], label: str) -> list[_T]:
        """FP8 casts: a one-byte copy and a 0-dim fp32 scale per tensor (notebook 10 measured this, to the byte)."""
        out = []
        for numel, what in tensors:
            out.append(self.new(numel, 1, "temporaries", f"{label} {what}"))
            out.append(self.new(1, 4, "temporaries", f"{label} {what} scale"))
        return out


class _LowBitStep(_LowBit, _Step):
    """``_Step`` with this module's options."""

    def __init__(self, model: ModelConfig, setup: TrainingSetup, trace: bool = False) -> None:
        super().__init__(model, setup, trace)
        self.lowbit_setup()
