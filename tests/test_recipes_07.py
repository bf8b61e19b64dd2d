"""Notebook 07's recipe (`attach_optimizer_in_backward`: one optimizer per trainable parameter, stepped and its
gradient freed from a post-accumulate-grad hook), taken from the notebook's cell tagged ``recipe``, run on models it
was not written for: an ``nn.Sequential``, a fused-qkv model, and a transformers Llama with tied embeddings, a frozen
parameter and padded labels, in fp32 and on a bf16 base. Each run asserts the notebook's claims: the same parameters
as a normal loop, no gradient left after backward, frozen parameters untouched, a lower peak."""
from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import utils
from tests.recipe_models import FusedQKVModel, padded_tokens, run_recipe, sequential_mlp, tiny_llama


@pytest.fixture(scope="module")
def attach():
    return run_recipe("07")["attach_optimizer_in_backward"]


def _adamw(params):
    return torch.optim.AdamW(params, lr=1e-2)


def _check(attach, model, loss_of, steps=3, exact=True):
    normal = copy.deepcopy(model)
    normal_optimizer = _adamw([p for p in normal.parameters() if p.requires_grad])
    frozen = {name: p.detach().clone() for name, p in model.named_parameters() if not p.requires_grad}
    optimizers, handles = attach(model, _adamw)
    for _ in range(steps):
        loss = loss_of(normal)                   # what backward and the update add on top of the forward's tensors:
        with utils.measure_memory("cpu", timeline=False, include=[normal, normal_optimizer]) as normal_memory:
            loss.backward()
            normal_optimizer.step()
            normal_optimizer.zero_grad(set_to_none=True)
        loss = loss_of(model)
        with utils.measure_memory("cpu", timeline=False, include=[model, list(optimizers.values())]) as hooked_memory:
            loss.backward()
        del loss
        assert all(p.grad is None for p in model.parameters()), "no gradient left after backward"
    for (name, p), q in zip(model.named_parameters(), normal.parameters()):
        if exact:
            assert torch.equal(p, q), name
        else:
            torch.testing.assert_close(p, q)
    for name, value in frozen.items():
        assert torch.equal(dict(model.named_parameters())[name], value), f"{name} is frozen"
    assert hooked_memory.peak_bytes < normal_memory.peak_bytes, "the gradients leave the peak"
    for handle in handles:
        handle.remove()
    return optimizers


def test_sequential(attach):
    x, target = torch.randn(2, 16), torch.randint(0, 5, (2,))        # few rows: the gradients set the peak
    _check(attach, sequential_mlp(), lambda m: nn.functional.cross_entropy(m(x), target))


def test_fused_qkv_model_with_padded_targets(attach):
    tokens, _, labels = padded_tokens(1, 6, 64)
    _check(attach, FusedQKVModel(),
           lambda m: nn.functional.cross_entropy(m(tokens).flatten(0, 1), labels.flatten()))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16 base"])
def test_llama_with_tied_embeddings_and_a_frozen_norm(attach, dtype):
    model = tiny_llama(dtype, tie=True)
    model.model.norm.weight.requires_grad_(False)
    input_ids, attention_mask, labels = padded_tokens(2, 8, 128)
    optimizers = _check(attach, model, lambda m: m(input_ids=input_ids, attention_mask=attention_mask,
                                                   labels=labels).loss)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert sum(p is model.lm_head.weight for p in optimizers) == 1, "a tied weight gets one optimizer and one hook"
    assert model.model.norm.weight not in optimizers
