"""The model's parameters, in ``model.parameters()`` order, for the course's two designs."""

from __future__ import annotations

import math

from .config import ModelConfig, TrainingSetup

def _linears(model: ModelConfig) -> list[tuple[str, int, int, bool]]:
    """A block's Linear layers: (name, in_features, out_features, attention?)."""
    d, f = model.d_model, model.ffn
    if model.arch == "gpt":
        return [("qkv", d, 3 * d, True), ("proj", d, d, True), ("mlp.0", d, f, False), ("mlp.2", f, d, False)]
    kv = model.kv_heads * model.head_dim
    return [("self_attn.q_proj", d, d, True), ("self_attn.k_proj", d, kv, True), ("self_attn.v_proj", d, kv, True),
            ("self_attn.o_proj", d, d, True), ("mlp.gate_proj", d, f, False), ("mlp.up_proj", d, f, False),
            ("mlp.down_proj", f, d, False)]


def _lora_on(setup: TrainingSetup, attention: bool) -> bool:
    return setup.lora_rank > 0 and (setup.lora_targets == "all" or attention)


def parameter_shapes(model: ModelConfig, setup: TrainingSetup | None = None) -> list[tuple[str, tuple[int, ...], bool]]:
    """Every parameter as (name, shape, trainable), in the order ``model.parameters()`` yields them.

    With LoRA (``setup.lora_rank > 0``) the base weights are frozen and each targeted Linear gains
    ``lora_a`` (rank, in) and ``lora_b`` (out, rank), trainable.

    Example:
        >>> sum(math.prod(s) for _, s, _ in parameter_shapes(PRESETS["7B"]))
        6738415616
    """
    setup = setup or TrainingSetup()
    if model.is_hf:
        from .hf_llama import hf_parameter_shapes

        return hf_parameter_shapes(model, setup)
    lora = setup.lora_rank > 0
    out: list[tuple[str, tuple[int, ...], bool]] = []
    d, v = model.d_model, model.vocab_size
    out.append(("token_embedding.weight" if model.arch == "gpt" else "embed_tokens.weight", (v, d), not lora))
    if model.arch == "gpt":
        out.append(("position_embedding.weight", (model.max_seq_len, d), not lora))
    for layer in range(model.num_layers):
        prefix = f"blocks.{layer}." if model.arch == "gpt" else f"layers.{layer}."
        linears = {name: (fan_in, fan_out, att) for name, fan_in, fan_out, att in _linears(model)}

        def linear(name: str) -> None:
            fan_in, fan_out, att = linears[name]
            if _lora_on(setup, att):                # LoRALinear's own parameters come before its base's
                out.append((prefix + name + ".lora_a", (setup.lora_rank, fan_in), True))
                out.append((prefix + name + ".lora_b", (fan_out, setup.lora_rank), True))
            out.append((prefix + name + ".weight", (fan_out, fan_in), not lora))
            if model.arch == "gpt":
                out.append((prefix + name + ".bias", (fan_out,), not lora))

        if model.arch == "gpt":
            out += [(prefix + "norm1.weight", (d,), not lora), (prefix + "norm1.bias", (d,), not lora)]
            linear("qkv")
            linear("proj")
            out += [(prefix + "norm2.weight", (d,), not lora), (prefix + "norm2.bias", (d,), not lora)]
            linear("mlp.0")
            linear("mlp.2")
        else:
            for name, _, _, _ in _linears(model):
                linear(name)
            out += [(prefix + "input_layernorm.weight", (d,), not lora),
                    (prefix + "post_attention_layernorm.weight", (d,), not lora)]
    if model.arch == "gpt":
        out += [("norm.weight", (d,), not lora), ("norm.bias", (d,), not lora),
                ("head.weight", (v, d), not lora), ("head.bias", (v,), not lora)]
    else:
        out.append(("norm.weight", (d,), not lora))
        if not model.tied_embeddings:
            out.append(("lm_head.weight", (v, d), not lora))
    return out


def count_parameters(model: ModelConfig, setup: TrainingSetup | None = None, *, trainable_only: bool = False) -> int:
    """Parameter elements of a ``ModelConfig`` (its LoRA adapters included when ``setup`` has a rank).

    Unlike ``utils.count_parameters``, which counts a built ``nn.Module``, this counts from the shape alone,
    so a 70B model needs no memory: ``count_parameters(PRESETS["70B"]) == 68_976_648_192``, the published count.

    Args:
        model: the shape.
        setup: for LoRA's adapters and frozen weights (default: full fine-tuning).
        trainable_only: count only what trains (the adapters, under LoRA).

    Returns:
        Elements (an int).
    """
    return sum(math.prod(shape) for _, shape, trainable in parameter_shapes(model, setup)
               if trainable or not trainable_only)
