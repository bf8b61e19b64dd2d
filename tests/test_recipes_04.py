"""Notebook 04's recipe (`train`: autocast around the forward and the loss, the GradScaler around backward and the
step, clipping after `unscale_`), taken from the notebook's cell tagged ``recipe``, run on models it was not
written for: an ``nn.Sequential``, a fused-qkv model and a transformers Llama with padded labels, in fp32, under
bf16 autocast over fp32 weights, on a bf16 base, and in fp16 with the scaler forced on."""
from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from tests.recipe_models import FusedQKVModel, padded_tokens, run_recipe, sequential_mlp, tiny_llama


@pytest.fixture(scope="module")
def train():
    return run_recipe("04")["train"]


def _scaler(dtype, **kwargs) -> torch.amp.GradScaler:
    return torch.amp.GradScaler("cpu", enabled=dtype == torch.float16, **kwargs)


def _token_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten())          # -100 is ignored


def _llama_loss(output, labels: torch.Tensor) -> torch.Tensor:
    return _token_loss(output.logits, labels)


def test_fp32_is_the_plain_clipped_step(train):
    """dtype None: exactly the step a plain loop with clipping takes."""
    model = sequential_mlp()
    reference = copy.deepcopy(model)
    x, target = torch.randn(12, 16), torch.randint(0, 5, (12,))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    train(model, optimizer, _scaler(None), [(x, target)] * 3, None)
    reference_optimizer = torch.optim.AdamW(reference.parameters(), lr=1e-2)
    for _ in range(3):
        nn.functional.cross_entropy(reference(x), target).backward()
        nn.utils.clip_grad_norm_(reference.parameters(), 1.0)
        reference_optimizer.step()
        reference_optimizer.zero_grad(set_to_none=True)
    for p, q in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(p, q, rtol=0, atol=0)


def test_bf16_autocast_over_fp32_weights_on_a_sequential(train):
    model = sequential_mlp()
    x, target = torch.randn(64, 16), torch.randint(0, 5, (64,))
    losses = train(model, torch.optim.AdamW(model.parameters(), lr=1e-2), _scaler(torch.bfloat16), [(x, target)] * 20,
                   torch.bfloat16)
    assert losses[-1] < losses[0] and all(p.dtype == torch.float32 for p in model.parameters())


@pytest.mark.parametrize("case", ["bf16 autocast over fp32 weights", "bf16 base"])
def test_llama_with_padded_labels(train, case):
    model = tiny_llama(torch.bfloat16 if case == "bf16 base" else torch.float32)
    input_ids, _, labels = padded_tokens(4, 12, 128)
    weights_dtype = next(model.parameters()).dtype
    losses = train(model, torch.optim.AdamW(model.parameters(), lr=3e-3), _scaler(torch.bfloat16),
                   [(input_ids, labels)] * 8, torch.bfloat16, loss_fn=_llama_loss)
    assert all(torch.isfinite(torch.tensor(losses))) and losses[-1] < losses[0]
    assert all(p.dtype == weights_dtype for p in model.parameters()), "autocast does not change the stored weights"


def test_bf16_autocast_gradients_are_close_to_fp32_on_a_fused_qkv_model(train):
    """The loss is computed in fp32 under autocast; the gradients differ from fp32's by bf16 rounding only."""
    model = FusedQKVModel()
    tokens, _, labels = padded_tokens(3, 10, 64)
    grads = {}
    for dtype in (None, torch.bfloat16):
        probe = copy.deepcopy(model)
        optimizer = torch.optim.SGD(probe.parameters(), lr=0.0)              # lr 0: keep the gradients to compare
        optimizer.zero_grad = lambda set_to_none=True: None
        train(probe, optimizer, _scaler(dtype), [(tokens, labels)], dtype, loss_fn=_token_loss, max_norm=float("inf"))
        grads[dtype] = torch.cat([p.grad.flatten() for p in probe.parameters()])
    relative = float((grads[torch.bfloat16] - grads[None]).norm() / grads[None].norm())
    assert 0 < relative < 16 * 2.0 ** -8, relative                       # a few units of bf16's precision (2^-8)


def test_fp16_scaler_carries_its_scale_across_calls(train):
    model = sequential_mlp()
    x, target = torch.randn(64, 16), torch.randint(0, 5, (64,))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    scaler = _scaler(torch.float16, init_scale=2.0**40, backoff_factor=2.0**-8)
    first = next(model.parameters())
    taken = []
    for _ in range(2):
        before = int(optimizer.state[first].get("step", 0))
        train(model, optimizer, scaler, [(x, target)] * 6, torch.float16)
        taken.append(int(optimizer.state[first].get("step", 0)) - before)
    assert taken[0] < 6 and taken[1] == 6, taken


def test_an_fp16_base_is_refused_by_the_scaler(train):
    """The limitation stated beside the recipe: fp16 weights have fp16 gradients, which unscale_ refuses."""
    model = sequential_mlp().half()
    x, target = torch.randn(8, 16).half(), torch.randint(0, 5, (8,))
    with pytest.raises(ValueError, match="unscale FP16 gradients"):
        train(model, torch.optim.SGD(model.parameters(), lr=1e-3), _scaler(torch.float16), [(x, target)], torch.float16)
