"""transformers' GPT-2 (``GPT2LMHeadModel``): its parameters, as transformers and peft name them.

GPT-2's training step (dropout after the embeddings, in attention and after each residual branch, ``Conv1D``
projections, ``gelu_new``) is not replayed yet: ``predict_hf`` on a GPT-2 config counts its parameters
(``count_parameters``) and refuses to predict the step, saying so.
"""

from __future__ import annotations

from .config import ModelConfig, TrainingSetup

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
