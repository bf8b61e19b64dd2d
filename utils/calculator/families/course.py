"""What the course's own two designs share (``course_gpt.py``: ``utils.TinyTransformer``; ``course_llama.py``:
``llama_like``): their LoRA (``LoRALinear``: ``base(x) + B(A(x)) * alpha / r``), their head and loss (whole or
chunked), the step ``reference_step`` measures, and the checks of options only transformers' models have.
"""

from __future__ import annotations

from typing import Any

from ..config import ModelConfig, TrainingSetup
from ..replay import _T
from .base import Family


class CourseDesign(Family):
    """A design of the course (no transformers config): ``reference.py`` builds and measures it."""

    model_types = ()
    block_prefix = ""                          # "blocks." or "layers."
    hf_only = ("head_width", "sliding_window", "layer_types")

    # -- checks --------------------------------------------------------------------------------------------
    def check_model(self, model: ModelConfig) -> None:
        given = [name for name in self.hf_only if getattr(model, name) is not None]
        given += [name for name in ("qkv_bias", "out_bias", "mlp_bias") if getattr(model, name)]
        given += (["attention"] if model.attention != "sdpa" else []) + (["dropout"] if any(model.dropout) else [])
        given += (["activation"] if model.activation is not None else []) + (["extra"] if model.extra else [])
        if given:
            raise ValueError(f"{', '.join(given)}: transformers' designs only (made by "
                             f"utils.calculator.model_config_from_hf); arch {model.arch!r} has none of them")

    def check_setup(self, model: ModelConfig, setup: TrainingSetup) -> None:
        given = [name for name, on in (("padded", setup.padded), ("lora_dropout", setup.lora_dropout > 0),
                                       ("lora_targets as module names", isinstance(setup.lora_targets, tuple)),
                                       (f"loss {setup.loss!r}", setup.loss != "labels"),
                                       ("reentrant", setup.reentrant),
                                       (f"outputs {setup.outputs!r}", setup.outputs not in (None, "dropped")))
                 if on]
        if given:
            raise ValueError(f"{', '.join(given)}: modelled for transformers' designs (predict_hf); the course's "
                             f"design {model.arch!r} replays reference_step, whose loss is computed inline (no "
                             "attention mask, LoRA dropout, peft module names or output object)")
        if setup.kbit_prepared:
            raise ValueError("kbit_prepared is peft's prepare_model_for_kbit_training, for transformers' models: "
                             "expected a transformers config (predict_hf, --hf-config)")

    def divides_loss(self, setup: TrainingSetup) -> bool:
        return True                               # reference_step: (loss / accumulation_steps).backward(), always

    # -- parameters ----------------------------------------------------------------------------------------
    def linears(self, model: ModelConfig) -> list[tuple[str, int, int, bool]]:
        """A block's Linear layers: (name, in_features, out_features, attention?)."""
        raise NotImplementedError

    def lora_on(self, setup: TrainingSetup, attention: bool) -> bool:
        return setup.lora_rank > 0 and (setup.lora_targets == "all" or attention)

    def lora_targets(self, model: ModelConfig, setup: TrainingSetup) -> set[str]:
        return {name for name, _, _, attention in self.linears(model) if self.lora_on(setup, attention)}

    def block_linear_weights(self, model: ModelConfig, setup: TrainingSetup) -> dict[str, tuple[int, int]]:
        return {f"{self.block_prefix}{layer}.{name}.weight": (fan_out, fan_in)
                for layer in range(model.num_layers) for name, fan_in, fan_out, _ in self.linears(model)}

    def linear_parameters(self, out: list, model: ModelConfig, setup: TrainingSetup, prefix: str, name: str,
                          bias: bool) -> None:
        """A block Linear's parameters: LoRALinear's own (lora_a, lora_b) before its base's."""
        fan_in, fan_out, attention = {n: (i, o, a) for n, i, o, a in self.linears(model)}[name]
        lora = setup.lora_rank > 0
        if self.lora_on(setup, attention):
            out.append((prefix + name + ".lora_a", (setup.lora_rank, fan_in), True))
            out.append((prefix + name + ".lora_b", (fan_out, setup.lora_rank), True))
        out.append((prefix + name + ".weight", (fan_out, fan_in), not lora))
        if bias:
            out.append((prefix + name + ".bias", (fan_out,), not lora))

    # -- the replay ----------------------------------------------------------------------------------------
    def lin(self, r: Any, x: _T, prefix: str, name: str, attention: bool, bias: bool) -> _T:
        """A block's Linear, with its LoRA adapter when targeted: ``base(x) + B(A(x)) * alpha / r``."""
        fan_out = {n: o for n, _, o, _ in self.linears(r.model)}[name]
        w = r.p(prefix + name + ".weight")
        b = r.p(prefix + name + ".bias") if bias else None
        base = r.linear(x, w, b, fan_out, prefix + name)
        if not self.lora_on(r.setup, attention):
            return base
        h = r.linear(x, r.p(prefix + name + ".lora_a"), None, r.setup.lora_rank, prefix + name + ".lora_a")
        low = r.linear(h, r.p(prefix + name + ".lora_b"), None, fan_out, prefix + name + ".lora_b")
        r.rel(h)
        scaled = r.mul_scalar(low, prefix + name + " lora scale")
        r.rel(low)
        out = r.add(base, scaled, prefix + name + " lora sum")
        r.rel(base, scaled)
        return out

    def head_loss(self, r: Any, final: _T, w: _T, b: _T | None) -> _T:
        """``F.cross_entropy(head(norm(x)).flatten(0, 1).float(), targets)`` or ``chunked_cross_entropy``."""
        if r.setup.chunked_loss:
            loss = r.chunked_loss(final, w, b)
            r.rel(final)
            return loss
        logits = r.linear(final, w, b, r.model.vocab_size, "logits")
        r.rel(final)
        for_loss = r.to_float(logits, "logits.float()")
        r.rel(logits)
        loss = r.cross_entropy(for_loss, r.setup.tokens)
        r.rel(for_loss)
        return loss

    # -- the measured side (torch, imported by reference.py's callers only) -----------------------------
    def build_reference_module(self, model: ModelConfig) -> Any:
        """The ``nn.Module`` ``reference_step`` trains."""
        raise NotImplementedError

    def reference_embed(self, net: Any, tokens: Any, seq_len: int) -> tuple[Any, tuple]:
        """The first block's input and the blocks' other arguments."""
        raise NotImplementedError
