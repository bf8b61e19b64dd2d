"""The protocol every model family implements, and how a family reads a transformers config field by field.

A family is one module of ``families/`` holding one object, registered by its ``arch`` and the transformers
``model_type`` values it reads (``registry.register``). The engine (``step.py``, ``predict.py``, ``fewer_bits.py``,
``data_parallel.py``, the model-parallel prediction) calls only what ``Family`` declares; the family's own module
is the only place that knows its design. To add one: write ``families/<name>.py`` with a subclass of ``Family``
(of ``TransformersDecoder`` in ``decoder.py`` for a transformers decoder: most families override a few of its
pieces), import it in ``families/__init__.py``, ship a config of it (``configs/``) and add its rows to the
transformers grid (``validate_hf.py``); the field-walking test (``tests/test_calculator_fields.py``) then says
which of its config's fields still need a decision.

Reading a config (``FieldRules``): every field of the transformers config class, and of ``PretrainedConfig``, is
either replayed (read into the ``ModelConfig``), listed as not changing training memory (with the reason), or
refused when set away from its default (the message names it). A field none of the three lists (a newer
transformers' field) is refused when it holds anything but None, False, 0 or an empty value.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Hashable, Mapping

from ..config import ModelConfig, TrainingSetup

# PretrainedConfig's own fields, for every transformers family
BASE_NO_EFFECT = {
    "_name_or_path": "the checkpoint's name",
    "architectures": "the class names a checkpoint was saved from; the calculator models the causal LM",
    "transformers_version": "the version that wrote the file",
    "dtype": "the checkpoint's storage dtype; the training precision is TrainingSetup.precision",
    "torch_dtype": "the old name of dtype",
    "return_dict": "the output's container type, not its tensors",
    "id2label": "a classification head's labels; the causal LM has none",
    "label2id": "a classification head's labels; the causal LM has none",
    "problem_type": "a classification head's loss; the causal LM's loss is TrainingSetup.loss",
    "bos_token_id": "a token id",
    "eos_token_id": "a token id",
    "pad_token_id": "a token id (the embedding's padding row is an ordinary row of the same table)",
    "initializer_range": "the initial weights' values, not their sizes",
    "rms_norm_eps": "a constant inside the norm",
    "layer_norm_epsilon": "a constant inside the norm",
    "tokenizer_class": "the tokenizer's name",
    "use_return_dict": "the output's container type",
    "auto_map": "where a checkpoint's own code lives; transformers' class is what the calculator models",
}
BASE_REFUSED = {
    "output_hidden_states": False,     # the output would keep every layer's hidden state
    "output_attentions": False,        # eager attention would return (and the output keep) every layer's weights
    "chunk_size_feed_forward": 0,      # chunked feed-forward layers are not replayed
    "is_encoder_decoder": False,       # decoder-only models are modelled
}
REFUSAL_HINTS = {
    "quantization_config": "a quantized checkpoint: model a 4-bit base with TrainingSetup(base_quant='nf4') "
                           "(--base-quant) on the unquantized config",
    "output_hidden_states": "the output would keep every layer's hidden state",
    "output_attentions": "the output would keep every layer's attention weights",
    "rope_scaling": "only static rotary scalings are replayed (default, linear, llama3, yarn)",
    "rope_parameters": "only static rotary scalings are replayed (default, linear, llama3, yarn) with "
                       "partial_rotary_factor 1",
}
STATIC_ROPE_TYPES = ("default", "linear", "llama3", "yarn")   # inv_freq fixed at init: the same tensors as default


@dataclass(frozen=True)
class FieldRules:
    """What a family does with each field of a transformers config class.

    Attributes:
        replayed: fields read into the ``ModelConfig`` and replayed.
        no_effect: field -> why it does not change training memory.
        refused: field -> its default: any other value is refused with a message that names the field.
    """

    replayed: frozenset[str]
    no_effect: Mapping[str, str] = field(default_factory=dict)
    refused: Mapping[str, Any] = field(default_factory=dict)

    def with_base(self) -> "FieldRules":
        """These rules plus ``PretrainedConfig``'s own fields (``attn_implementation`` is read by
        ``model_config_from_hf``)."""
        return FieldRules(self.replayed | {"attn_implementation"}, {**BASE_NO_EFFECT, **self.no_effect},
                          {**BASE_REFUSED, **self.refused})

    def decided(self) -> set[str]:
        """Every field these rules decide."""
        return set(self.replayed) | set(self.no_effect) | set(self.refused)


def _is_default(value: Any, default: Any) -> bool:
    return value == default or (_empty(value) and _empty(default))


def _empty(value: Any) -> bool:
    return value is None or value is False or value == 0 or value in ("", [], {}, ())


def check_fields(fields: Mapping[str, Any], rules: FieldRules, what: str) -> None:
    """Refuse every field the rules refuse at a value other than its default, and every unknown field that is set.

    Args:
        fields: the config as a dict (``to_dict()`` or a config.json).
        rules: the family's rules for this ``model_type`` (``with_base()`` applied).
        what: how messages name the config (``"transformers 5.24's LlamaConfig"``).

    Raises:
        ValueError: naming the first such field, its value and what was expected.
    """
    decided = rules.decided()
    for name, value in fields.items():
        if name.startswith("_") or name == "model_type":
            continue
        if name in rules.refused:
            if not _is_default(value, rules.refused[name]):
                hint = REFUSAL_HINTS.get(name, "the calculator does not replay what it changes")
                raise ValueError(f"{name}={value!r} is not modelled ({hint}): expected the default "
                                 f"{rules.refused[name]!r} of {what}")
        elif name not in decided and not _empty(value):
            hint = REFUSAL_HINTS.get(name, f"it is not a field of {what}, and the calculator does not know what "
                                           "it changes")
            raise ValueError(f"{name}={value!r} is not modelled ({hint}): expected it absent or null")


def rope_settings(fields: Mapping[str, Any], key: str | None = None) -> None:
    """Refuse a rotary embedding whose frequencies change during training or that rotates part of each head.

    ``rope_parameters`` (or the older ``rope_scaling``), per layer type when ``key`` names one (Gemma 3).
    """
    for name in ("rope_parameters", "rope_scaling"):
        params = fields.get(name)
        if not params:
            continue
        if key is not None and isinstance(params, dict) and key in params:
            params = params[key] or {}
        elif key is not None and isinstance(params, dict) and any(k in params for k in ("full_attention",
                                                                                        "sliding_attention")):
            continue
        if not isinstance(params, dict):
            raise ValueError(f"{name}={params!r}: expected a dict (transformers' rope parameters)")
        kind = params.get("rope_type", params.get("type", "default"))
        if kind not in STATIC_ROPE_TYPES:
            raise ValueError(f"{name} with rope_type {kind!r} is not modelled ({REFUSAL_HINTS[name]}): expected one "
                             f"of {STATIC_ROPE_TYPES}")
        if params.get("partial_rotary_factor", 1.0) != 1.0:
            raise ValueError(f"{name} with partial_rotary_factor {params['partial_rotary_factor']!r} is not "
                             f"modelled: expected 1.0 (every dimension of each head rotated)")


def require(fields: Mapping[str, Any], needed: tuple[str, ...], model_type: str) -> None:
    """Raise naming the fields of ``needed`` the config lacks."""
    missing = [name for name in needed if fields.get(name) is None]
    if missing:
        raise ValueError(f"the {model_type} config lacks {missing}: expected every one of {list(needed)}")


class Family:
    """A model family: what the engine asks of it. Every method gets what it needs; none is asked which family.

    Attributes:
        arch: the ``ModelConfig.arch`` it models.
        model_types: the transformers ``model_type`` values it reads (empty for the course's own designs).
        rules: ``model_type`` -> ``FieldRules`` of its config class (transformers' families).
    """

    arch: str = ""
    model_types: tuple[str, ...] = ()
    rules: Mapping[str, FieldRules] = {}

    # -- reading and checking ------------------------------------------------------------------------------
    def read_config(self, fields: dict[str, Any], attention: str, name: str) -> ModelConfig:
        """A ``ModelConfig`` from a transformers config dict (its fields checked by ``rules`` first)."""
        raise ValueError(f"arch {self.arch!r} is one of the course's designs: it has no transformers config")

    def check_model(self, model: ModelConfig) -> None:
        """Refuse ``ModelConfig`` fields this design does not have (called when a ``ModelConfig`` is made)."""

    def check_setup(self, model: ModelConfig, setup: TrainingSetup) -> None:
        """Refuse a ``TrainingSetup`` this design does not model, naming the option; before any work."""

    def outputs(self, setup: TrainingSetup) -> str:
        """What the reader's loop does with the model's output (``TrainingSetup.outputs`` resolved)."""
        return setup.outputs or "dropped"

    def divides_loss(self, setup: TrainingSetup) -> bool:
        """Whether each micro-batch's ``(loss / accumulation_steps).backward()`` divides it first."""
        return setup.accumulation_steps > 1

    def describe(self, model: ModelConfig, setup: TrainingSetup) -> str:
        """The set-up's words for ``format_table``'s second line that only this kind of design has."""
        return f"loss {'chunked by ' + str(setup.chunked_loss) if setup.chunked_loss else 'whole'}, "

    def peft_default_targets(self, model: ModelConfig) -> tuple[str, ...]:
        """peft's default ``target_modules`` for this model type (``LoraConfig`` without them)."""
        return ("q_proj", "v_proj")

    # -- parameters ----------------------------------------------------------------------------------------
    def parameter_shapes(self, model: ModelConfig, setup: TrainingSetup) -> list[tuple[str, tuple[int, ...], bool]]:
        """Every parameter as (name, shape, trainable), in ``model.parameters()`` order (LoRA's adapters too)."""
        raise NotImplementedError

    def leaf_item(self, name: str, setup: TrainingSetup) -> int:
        """Bytes per element of a parameter."""
        return 2 if setup.precision == "bf16" else 4

    def lora_targets(self, model: ModelConfig, setup: TrainingSetup) -> set[str]:
        """The module paths inside a block LoRA adapts (empty without LoRA); a target naming nothing raises."""
        return set()

    def block_linear_weights(self, model: ModelConfig, setup: TrainingSetup) -> dict[str, tuple[int, int]]:
        """Every Linear weight inside the blocks: name -> (out, in) (what a 4-bit loader quantises, FP8 converts)."""
        raise ValueError(f"arch {self.arch!r}: fewer-bits options are not modelled for this design")

    def tensor_parallel_dim(self, name: str, shape: tuple[int, ...]) -> int | None:
        """The dimension tensor parallelism splits (Megatron's layout), or None: whole on every rank."""
        return None

    def activation_design(self) -> str:
        """Notebook 13's per-layer activation count for this design: ``"gpt"`` or ``"llama"``."""
        raise ValueError(f"arch {self.arch!r}: model parallelism is not modelled for this design")

    def batch_arrays(self, setup: TrainingSetup) -> int:
        """int64 arrays of (tokens) each the step's batch holds (ids and targets; an attention mask)."""
        return 2

    # -- the replay ----------------------------------------------------------------------------------------
    def layer_signature(self, model: ModelConfig, layer: int) -> Hashable:
        """Blocks with equal signatures replay identically in the middle of the stack (``layer_reuse.py``)."""
        return model.layer_type(layer)

    def buffers(self, r: Any) -> None:
        """Allocate the model's buffers (they live with the parameters)."""

    def step_begin(self, r: Any) -> None:
        """What the step allocates before its first micro-batch."""

    def forward(self, r: Any, micro: int) -> Any:
        """One micro-batch's forward, up to and including its loss (the ``_T`` the engine backwards)."""
        raise NotImplementedError

    def after_backward(self, r: Any, micro: int) -> None:
        """What goes after a micro-batch's backward (a leaf made for checkpointing and its gradient)."""
