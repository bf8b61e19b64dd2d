"""Notebook 10's recipe (NF4 quantise/dequantise with double-quantised scales, the 4-bit LoRA linear, stochastic
rounding and Kahan summation, AdamW on bf16 states, the FP8 casts with tensorwise, rowwise and block scales), taken
from the notebook's cells tagged ``recipe``, run on models it was not written for: a bf16 ``nn.Linear`` base, the
reader's transformers families (Llama, Qwen2 with biases and a tied head, GPT-2 with its ``Conv1D`` layers, the bf16
Mistral with a sliding window) on padded dict batches from a ``DataLoader``, an ``nn.Sequential`` and a fused-qkv
model. Bad input is refused with a message that says what was expected, and each recipe cell names what it expects
the reader's script to define."""
from __future__ import annotations

import ast
import builtins
import copy
import re

import pytest
import torch
from torch import nn

from tests.recipe_models import (CAUSAL_LM_FAMILIES, FusedQKVModel, padded_dict_batches, padded_tokens, recipe_cells,
                                 run_recipe, sequential_mlp, tiny_llama)

# the Linear layers a 4-bit loader quantises in each family's blocks (GPT-2's are transformers' Conv1D)
BLOCK_LINEARS = {"llama": ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"),
                 "gpt2": ("c_attn", "c_proj", "c_fc")}


@pytest.fixture(scope="module")
def recipe():
    return run_recipe("10")


def _nf4_weight(recipe, layer) -> torch.Tensor:
    absmax = recipe["dequantize_scales"](layer.scale_codes, layer.scale_absmax, layer.scale_offset)
    return recipe["dequantize_nf4"](layer.packed, absmax, layer.shape, torch.float32)


def test_nf4_round_trip_within_the_format_bound(recipe):
    weight = torch.randn(96, 64, dtype=torch.bfloat16)
    packed, absmax = recipe["quantize_nf4"](weight, 64)
    assert packed.dtype == torch.uint8 and packed.numel() == weight.numel() // 2 and absmax.numel() == 96
    levels = recipe["nf4_levels"]()
    half_gap = ((levels[1:] - levels[:-1]) / 2).max()
    restored = recipe["dequantize_nf4"](packed, absmax, weight.shape, torch.float32)
    error = (restored - weight.float()).abs().view(-1, 64)
    # the bf16 output of dequantize_nf4 would add its own rounding; fp32 here is the format's bound alone
    assert (error <= absmax[:, None] * half_gap * (1 + 1e-6)).all()


def test_bad_input_is_refused_with_what_was_expected(recipe):
    with pytest.raises(ValueError, match="divides"):
        recipe["quantize_nf4"](torch.randn(10, 10), 64)
    with pytest.raises(TypeError, match="floating-point"):
        recipe["quantize_nf4"](torch.ones(64, 64, dtype=torch.int32), 64)
    with pytest.raises(ValueError, match="float8"):
        recipe["to_fp8"](torch.randn(4), torch.float16)
    with pytest.raises(ValueError, match="rounding"):
        recipe["adamw_bf16_step"]([], {}, 1e-3, rounding="up")


def test_lora_4bit_on_a_bf16_linear_matches_its_dequantised_weight(recipe):
    torch.manual_seed(0)
    base = nn.Linear(64, 128).to(torch.bfloat16)
    layer = recipe["LoRALinear4bit"](base, rank=4, alpha=8.0)
    x = torch.randn(3, 5, 64, dtype=torch.bfloat16, requires_grad=True)
    expected = nn.functional.linear(x.float(), _nf4_weight(recipe, layer), base.bias.float())
    torch.testing.assert_close(layer(x).float(), expected, rtol=2e-2, atol=2e-2)   # B starts at 0
    layer(x).float().sum().backward()
    assert layer.A.grad is not None and layer.B.grad is not None and x.grad is not None
    assert not layer.bias.requires_grad and layer.bias.grad is None
    assert {name for name, p in layer.named_parameters() if p.requires_grad} == {"A", "B"}


def test_lora_4bit_on_a_transformers_llama_with_padded_labels(recipe):
    model = tiny_llama(torch.bfloat16).requires_grad_(False)
    names = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
    for layer in model.model.layers:
        for parent in (layer.self_attn, layer.mlp):
            for name in names:
                if hasattr(parent, name):
                    setattr(parent, name, recipe["LoRALinear4bit"](getattr(parent, name), rank=4))
    input_ids, attention_mask, labels = padded_tokens(3, 12, 128)
    adapters = [p for p in model.parameters() if p.requires_grad]
    assert len(adapters) == 2 * 7 * len(model.model.layers)
    optimizer = torch.optim.AdamW(adapters, lr=1e-2)
    losses = []
    for _ in range(3):
        loss = model(input_ids=input_ids, attention_mask=attention_mask, labels=labels).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
    assert all(torch.isfinite(torch.tensor(losses))) and losses[-1] < losses[0]


def test_stochastic_rounding_is_unbiased_and_exact_on_bf16_values(recipe):
    round_stochastic = recipe["round_stochastic"]
    exact = torch.tensor([0.0, 1.0, -3.5, 2.0 ** -20])
    assert torch.equal(round_stochastic(exact).float(), exact)
    between = torch.full((40000,), 1.0 + 2.0 ** -9)                 # a quarter of the way from 1 to 1 + 2^-7
    up = (round_stochastic(between).float() > 1).float().mean().item()
    assert abs(up - 0.25) < 0.02
    down = (round_stochastic(-between).float() < -1).float().mean().item()
    assert abs(down - 0.25) < 0.02


@pytest.mark.parametrize("rounding", ["stochastic", "kahan", "nearest"])
@pytest.mark.parametrize("make", [sequential_mlp, FusedQKVModel], ids=["sequential", "fused-qkv"])
def test_adamw_bf16_step_trains_the_readers_models(recipe, rounding, make):
    model = make().to(torch.bfloat16)
    if make is sequential_mlp:
        x, target = torch.randn(32, 16, dtype=torch.bfloat16), torch.randint(0, 5, (32,))
        loss_fn = lambda: nn.functional.cross_entropy(model(x).float(), target)            # noqa: E731
    else:
        tokens = torch.randint(0, 64, (4, 8))
        loss_fn = lambda: nn.functional.cross_entropy(model(tokens).float().flatten(0, 1), tokens.flatten())  # noqa: E731
    state: dict = {}
    losses = []
    for _ in range(8):
        loss = loss_fn()
        loss.backward()
        recipe["adamw_bf16_step"](list(model.parameters()), state, 1e-2, rounding=rounding)
        model.zero_grad(set_to_none=True)
        losses.append(loss.item())
    assert losses[-1] < losses[0]
    assert all(p.dtype == torch.bfloat16 for p in model.parameters())
    per_param = {key for s in state.values() if isinstance(s, dict) for key in s}
    assert per_param == ({"m", "v", "c"} if rounding == "kahan" else {"m", "v"})


def test_fp8_cast_round_trip_tensorwise_and_rowwise(recipe):
    x = torch.randn(8, 32) * torch.logspace(-2, 2, 8)[:, None]       # rows of very different scales
    errors = {}
    for rowwise in (False, True):
        x8, scale = recipe["to_fp8"](x, torch.float8_e4m3fn, rowwise)
        assert x8.dtype == torch.float8_e4m3fn and x8.float().abs().max() <= 448
        errors[rowwise] = ((recipe["from_fp8"](x8, scale, torch.float32) - x).norm(dim=1) / x.norm(dim=1)).max()
    assert errors[True] <= 2 ** -4 and errors[True] < errors[False]


# --- issue 38: what each recipe cell expects; bad input refused; the reader's families -----------------------------

def _free_names(source: str) -> set[str]:
    """Names a cell reads but neither defines nor imports (nor are builtins): what a pasted cell needs defined."""
    tree = ast.parse(source)
    defined = {node.id for node in ast.walk(tree) if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store)}
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
            defined.add(node.name)
            if isinstance(node, ast.FunctionDef):
                defined |= {a.arg for a in node.args.args + node.args.kwonlyargs}
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            defined |= {(alias.asname or alias.name).split(".")[0] for alias in node.names}
        elif isinstance(node, ast.comprehension):
            defined |= {n.id for n in ast.walk(node.target) if isinstance(n, ast.Name)}
    used = {node.id for node in ast.walk(tree) if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Load)}
    return used - defined - set(dir(builtins))


def test_every_recipe_cell_names_what_the_readers_script_must_define():
    for source in recipe_cells("10"):
        first = source.splitlines()[0]
        assert first.startswith("# Expects:"), f"a recipe cell must start with '# Expects: ...', got {first!r}"
        named = set(re.findall(r"[A-Za-z_][A-Za-z0-9_]*", first))
        missing = _free_names(source) - named
        assert not missing, f"the cell starting {source.splitlines()[1]!r} also needs {sorted(missing)}: {first!r}"


@pytest.mark.parametrize("rank", [0, -2, 2.0, True])
def test_lora_4bit_refuses_a_rank_that_is_not_a_positive_int(recipe, rank):
    with pytest.raises(ValueError, match="rank must be a positive int"):
        recipe["LoRALinear4bit"](nn.Linear(64, 64).to(torch.bfloat16), rank)


def test_lora_4bit_refuses_a_layer_it_cannot_quantise(recipe):
    with pytest.raises(TypeError, match="nn.Linear or transformers' Conv1D, got Conv2d"):
        recipe["LoRALinear4bit"](nn.Conv2d(8, 8, 3), 4)


def test_adamw_bf16_step_refuses_fp32_weights_before_updating_anything(recipe):
    bf16, fp32 = nn.Parameter(torch.ones(4, dtype=torch.bfloat16)), nn.Parameter(torch.ones(4))
    bf16.grad, fp32.grad = torch.ones_like(bf16), torch.ones_like(fp32)
    with pytest.raises(TypeError, match=r"expects torch.bfloat16 weights .*torch.float32.*torch.optim.AdamW"):
        recipe["adamw_bf16_step"]([bf16, fp32], {}, 1e-2)
    assert torch.equal(bf16.detach(), torch.ones(4, dtype=torch.bfloat16)) and torch.equal(fp32.detach(), torch.ones(4))


def test_adamw_bf16_step_takes_a_parameter_generator(recipe):
    model = sequential_mlp().to(torch.bfloat16)
    x, target = torch.randn(16, 16, dtype=torch.bfloat16), torch.randint(0, 5, (16,))
    nn.functional.cross_entropy(model(x).float(), target).backward()
    before = [p.detach().clone() for p in model.parameters()]
    state: dict = {}
    recipe["adamw_bf16_step"](model.parameters(), state, 1e-2, rounding="nearest")
    assert state["step"] == 1 and all(not torch.equal(a, p) for a, p in zip(before, model.parameters()))


def _quantise_blocks(recipe, model: nn.Module, family: str, rank: int = 4) -> list[str]:
    """Replace every block Linear (Conv1D for GPT-2) by the recipe's 4-bit LoRA layer; return their names."""
    wanted = BLOCK_LINEARS["gpt2" if family == "gpt2" else "llama"]
    replaced = []
    for name, module in list(model.named_modules()):
        for child_name, child in list(module.named_children()):
            if child_name in wanted and (isinstance(child, nn.Linear) or type(child).__name__ == "Conv1D"):
                setattr(module, child_name, recipe["LoRALinear4bit"](child, rank))
                replaced.append(f"{name}.{child_name}")
    return replaced


def _nf4_round_trip_(recipe, model: nn.Module, family: str) -> None:
    """Set every block Linear's weight to its NF4 round trip, in place (GPT-2's Conv1D weight is stored transposed)."""
    wanted = BLOCK_LINEARS["gpt2" if family == "gpt2" else "llama"]
    for module in list(model.modules()):
        for child_name, child in module.named_children():
            if child_name in wanted:
                conv1d = type(child).__name__ == "Conv1D"
                weight = child.weight.T if conv1d else child.weight
                packed, absmax = recipe["quantize_nf4"](weight, 64)
                absmax = recipe["dequantize_scales"](*recipe["quantize_scales"](absmax))
                restored = recipe["dequantize_nf4"](packed, absmax, tuple(weight.shape), child.weight.dtype)
                with torch.no_grad():
                    child.weight.copy_(restored.T if conv1d else restored)


@pytest.mark.parametrize("family", sorted(CAUSAL_LM_FAMILIES))
def test_lora_4bit_on_the_readers_families_computes_the_nf4_model_and_trains(recipe, family):
    model = CAUSAL_LM_FAMILIES[family](dtype=torch.bfloat16).requires_grad_(False)
    reference = copy.deepcopy(model)
    _nf4_round_trip_(recipe, reference, family)
    replaced = _quantise_blocks(recipe, model, family)
    assert len(replaced) == (4 if family == "gpt2" else 7) * len(reference.base_model.h if family == "gpt2"
                                                                   else reference.model.layers)
    batches = padded_dict_batches(4, vocab=128)
    model.eval(), reference.eval()                                     # no dropout: the same function, B = 0
    torch.testing.assert_close(model(**batches[0]).logits.float(), reference(**batches[0]).logits.float(),
                               rtol=3e-2, atol=3e-2)
    model.train()
    trainable = [name for name, p in model.named_parameters() if p.requires_grad]
    assert trainable and all(name.endswith((".A", ".B")) for name in trainable)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    first = model(**batches[0]).loss.item()
    for _ in range(4):
        for batch in batches:
            model(**batch).loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
    model.eval()
    assert model(**batches[0]).loss.item() < first


@pytest.mark.parametrize("family", sorted(CAUSAL_LM_FAMILIES))
def test_adamw_bf16_step_trains_the_readers_families_in_bf16(recipe, family):
    model = CAUSAL_LM_FAMILIES[family](dtype=torch.bfloat16)
    if family == "gpt2":
        model.eval()                                                     # dropout off: the loss must fall
    batches = padded_dict_batches(4, vocab=128)
    state: dict = {}
    losses = []
    for _ in range(6):
        loss = model(**batches[0]).loss
        loss.backward()
        recipe["adamw_bf16_step"](model.parameters(), state, 3e-3, rounding="stochastic")
        model.zero_grad(set_to_none=True)
        losses.append(loss.item())
    assert losses[-1] < losses[0] and all(p.dtype == torch.bfloat16 for p in model.parameters())
    tensors = [s for key, s in state.items() if key != "step"]
    assert len(tensors) == len(list(model.parameters()))              # a tied head is one parameter, one state
    if family in ("qwen2", "gpt2"):
        assert model.lm_head.weight is model.get_input_embeddings().weight


def test_block_scaled_fp8_mx_scales_are_powers_of_two_in_e8m0_and_confine_an_outlier(recipe):
    torch.manual_seed(0)
    x = torch.randn(16, 256)
    x[:, 3] *= 1e5                                                     # an outlier channel: every row holds it
    errors = {}
    for label, (block, mx) in {"tensorwise": (256 * 16, False), "tiles": (128, False), "mx": (32, True)}.items():
        if label == "tensorwise":
            x8, scale = recipe["to_fp8"](x)
            restored = recipe["from_fp8"](x8, scale, torch.float32)
        else:
            x8, scale = recipe["to_fp8_blocks"](x, torch.float8_e4m3fn, block, mx=mx)
            restored = recipe["from_fp8_blocks"](x8, scale, torch.float32)
            assert x8.shape == x.shape and scale.shape == (16, 256 // block)
        ordinary = torch.ones_like(x, dtype=torch.bool)
        ordinary[:, 3] = False
        errors[label] = ((restored - x)[ordinary].norm() / x[ordinary].norm()).item()
        if mx:
            assert scale.dtype == torch.float8_e8m0fnu
            assert torch.equal(scale.float(), torch.exp2(torch.log2(scale.float()).round()))
    assert max(errors["mx"], errors["tiles"]) < 0.5 * errors["tensorwise"], errors
    with pytest.raises(ValueError, match="multiple of block=128"):
        recipe["to_fp8_blocks"](torch.randn(4, 96))
