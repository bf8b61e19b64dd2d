"""Notebook 09's LoRA recipe (``LoRALinear``, ``add_lora``, ``merge_lora``), taken from the notebook's `recipe`
cells, on models the notebook was not written for: a transformers Llama (fp32, a bf16 base, bf16 autocast over
fp32 weights, padded labels), an ``nn.Sequential`` and a model with a fused qkv weight that forward ``.split``s.

Each run asserts the notebook's claims: the adapted model starts as the base model; only the adapters train, and
they number ``r · (in + out)`` per wrapped Linear; a gradient step changes the output; merged, it computes what the
adapted model computes with the plain model's parameters.
"""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from tests.recipe_models import FusedQKVModel, padded_tokens, run_recipe, sequential_mlp, tiny_llama

RANK = 4


@pytest.fixture(scope="module")
def recipe() -> dict:
    return run_recipe("09")


def _expected_trainable(model: nn.Module, skip: tuple[str, ...]) -> int:
    return sum(RANK * (m.in_features + m.out_features) for name, m in model.named_modules()
               if isinstance(m, nn.Linear) and name.rsplit(".", 1)[-1] not in skip)


def _loss(model: nn.Module, kind: str, batch) -> torch.Tensor:
    if kind == "llama":
        input_ids, attention_mask, labels = batch
        return model(input_ids, attention_mask=attention_mask, labels=labels).loss
    inputs, targets = batch
    return F.cross_entropy(model(inputs).float().flatten(0, -2), targets.flatten())


def _case(kind: str, dtype: torch.dtype):
    if kind == "llama":
        pytest.importorskip("transformers")
        return tiny_llama(dtype), padded_tokens(3, 10, 128), ("lm_head",)
    if kind == "fused qkv":
        tokens, _, labels = padded_tokens(3, 10, 64)
        return FusedQKVModel().to(dtype), (tokens, labels), ("head", "qkv")     # its forward reads qkv.weight itself
    targets = torch.randint(0, 5, (12,))
    targets[::4] = -100
    return sequential_mlp().to(dtype), (torch.randn(12, 16).to(dtype), targets), ("head",)


@pytest.mark.parametrize("kind", ["sequential", "fused qkv", "llama"])
@pytest.mark.parametrize("case", ["fp32", "bf16 base", "bf16 autocast over fp32"])
def test_lora_starts_as_the_base_trains_and_merges(recipe, kind, case):
    model, batch, skip = _case(kind, torch.bfloat16 if case == "bf16 base" else torch.float32)
    base = copy.deepcopy(model)
    expected = _expected_trainable(model, skip)
    recipe["add_lora"](model, RANK, 16.0, skip=skip)
    adapters = [p for p in model.parameters() if p.requires_grad]
    assert sum(p.numel() for p in adapters) == expected
    assert all(p.dtype == next(base.parameters()).dtype for p in adapters)        # the base's dtype
    autocast = torch.autocast("cpu", torch.bfloat16, enabled=case == "bf16 autocast over fp32")
    with torch.no_grad(), autocast:
        assert torch.equal(_loss(model, kind, batch), _loss(base, kind, batch))   # B starts at zero
    optimizer = torch.optim.AdamW(adapters, lr=1e-2)
    for _ in range(2):                                                           # after one step B is not zero
        with autocast:
            loss = _loss(model, kind, batch)
        loss.backward()
        assert all(p.grad is not None for p in adapters)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    with torch.no_grad(), autocast:
        trained_loss = _loss(model, kind, batch)
        assert not torch.equal(trained_loss, _loss(base, kind, batch))            # it trained
        merged = recipe["merge_lora"](model)
        assert [p.shape for p in merged.parameters()] == [p.shape for p in base.parameters()]
        tolerance = 1e-4 if case == "fp32" else 5e-2                                # the merge rounds to 16 bits
        assert abs(_loss(merged, kind, batch).item() - trained_loss.item()) <= tolerance * abs(trained_loss.item())


def test_fp32_adapters_on_a_bf16_base(recipe):
    layer = recipe["LoRALinear"](nn.Linear(8, 6).to(torch.bfloat16), RANK, dtype=torch.float32)
    assert layer.A.dtype == layer.B.dtype == torch.float32
    out = layer(torch.randn(5, 8, dtype=torch.bfloat16))
    assert out.dtype == torch.bfloat16                                           # the base's output dtype
    out.float().sum().backward()
    assert layer.B.grad.dtype == torch.float32 and layer.base.weight.grad is None


def test_a_model_that_reads_a_wrapped_weight_itself_raises(recipe):
    model = FusedQKVModel()
    recipe["add_lora"](model, RANK, skip=("head",))                              # qkv wrapped: its .weight is gone
    with pytest.raises(AttributeError):
        model(torch.zeros(1, 4, dtype=torch.long))


def test_bad_ranks_raise(recipe):
    for rank in (0, 7, 2.0):
        with pytest.raises(ValueError, match="rank must be an int"):
            recipe["LoRALinear"](nn.Linear(8, 6), rank)
