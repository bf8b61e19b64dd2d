"""Notebook 05's recipe (an ordinary training loop on `torch.compile(model)`), taken from the notebook's cell tagged
``recipe``, run on models it was not written for: an ``nn.Sequential`` and a fused-qkv model with padded targets,
in fp32 and under bf16 autocast. The claim: the compiled model shares the model's parameters, so the same loop
trains it, to the same losses and weights as eager up to floating-point rounding. The backend is
``aot_eager_decomp_partition`` (graph capture, AOTAutograd and its partitioner, no C++ build), as in check mode."""
from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from tests.recipe_models import FusedQKVModel, padded_tokens, run_recipe, sequential_mlp

BACKEND = "aot_eager_decomp_partition"


@pytest.fixture(scope="module")
def train():
    return run_recipe("05")["train"]


def _token_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten())          # -100 is ignored


def _compare(train, model, batches, loss_fn, tolerance):
    """Same parameters, the same gradients as eager to rounding, and the same training (AdamW compounds the rounding,
    so later losses are compared as the notebook does: within 1 %)."""
    torch._dynamo.reset()
    eager = copy.deepcopy(model)
    compiled = torch.compile(model, backend=BACKEND)
    assert {id(p) for p in compiled.parameters()} == {id(p) for p in model.parameters()}, "the same parameters"
    inputs, labels = batches[0]
    loss_fn(compiled(inputs), labels).backward()
    loss_fn(eager(inputs), labels).backward()
    for p, q in zip(model.parameters(), eager.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=tolerance, atol=tolerance)
        p.grad = q.grad = None
    _, compiled_losses = train(compiled, batches, loss_fn)
    _, eager_losses = train(eager, batches, loss_fn)
    assert abs(compiled_losses[0] - eager_losses[0]) <= tolerance * max(1.0, abs(eager_losses[0]))
    assert abs(compiled_losses[-1] - eager_losses[-1]) <= 0.01 * max(1.0, abs(eager_losses[-1]))
    assert compiled_losses[-1] < compiled_losses[0]


def test_compiled_sequential_trains_like_eager(train):
    x, target = torch.randn(16, 16), torch.randint(0, 5, (16,))
    _compare(train, sequential_mlp(), [(x, target)] * 4, nn.functional.cross_entropy, 1e-5)


def test_compiled_fused_qkv_model_with_padded_targets(train):
    tokens, _, labels = padded_tokens(3, 10, 64)
    _compare(train, FusedQKVModel(), [(tokens, labels)] * 3, _token_loss, 1e-5)


def test_compiled_under_bf16_autocast(train):
    tokens, _, labels = padded_tokens(3, 10, 64)

    def autocast_loss(logits, labels):
        return _token_loss(logits.float(), labels)

    class Autocast(nn.Module):                     # the reader's forward under autocast, compiled as a whole
        def __init__(self, inner):
            super().__init__()
            self.inner = inner

        def forward(self, tokens):
            with torch.autocast("cpu", dtype=torch.bfloat16):
                return self.inner(tokens)

    _compare(train, Autocast(FusedQKVModel()), [(tokens, labels)] * 3, autocast_loss, 2.0 ** -6)
