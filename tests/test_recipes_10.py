"""Notebook 10's recipe (NF4 quantise/dequantise with double-quantised scales, the 4-bit LoRA linear, stochastic
rounding and Kahan summation, AdamW on bf16 states, the FP8 cast), taken from the notebook's cells tagged ``recipe``,
run on models it was not written for: a bf16 ``nn.Linear`` base, a transformers Llama's linears with padded labels,
an ``nn.Sequential`` and a fused-qkv model. Bad input is refused with a message that says what was expected."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from tests.recipe_models import FusedQKVModel, padded_tokens, run_recipe, sequential_mlp, tiny_llama


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
