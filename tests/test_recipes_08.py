"""Notebook 08's recipes, taken from the notebook's `recipe` cells, on models the notebook was not written for.

Recipes: ``train_with_budget`` (compile's memory budget), ``bf16_hooks`` (saved activations stored in bf16) and
``ChunkedCrossEntropy`` (the head and the loss, chunk by chunk). Models: an ``nn.Sequential``, a model with a fused
qkv weight that forward ``.split``s, and a transformers Llama built from a config; cases: padded targets (-100),
bf16 autocast over fp32 weights, a bf16 model, a chunk size that does not divide the number of tokens.
"""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

import utils
from tests.recipe_models import FusedQKVModel, padded_tokens, run_recipe, sequential_mlp, tiny_llama


@pytest.fixture(scope="module")
def recipe() -> dict:
    return run_recipe("08")


def _param_storages(model: torch.nn.Module) -> set[int]:
    return {p.untyped_storage().data_ptr() for p in model.parameters()}


def _hooked_forward(recipe: dict, model: torch.nn.Module, forward):
    """Run ``forward()`` under the recipe's hooks; return its output and, per saved tensor, (is a weight view, packed)."""
    pack, unpack = recipe["bf16_hooks"](model)
    storages, seen = _param_storages(model), []

    def watching_pack(tensor):
        packed = pack(tensor)
        seen.append((tensor.untyped_storage().data_ptr() in storages, packed[1] is not None))
        return packed

    with torch.autograd.graph.saved_tensors_hooks(watching_pack, unpack):
        output = forward()
    return output, seen


def _relative(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got - want).norm() / want.norm())


def test_bf16_hooks_halve_a_sequential_models_activations_to_the_byte(recipe):
    model = sequential_mlp()
    inputs, classes = torch.randn(16, 16), torch.randint(0, 5, (16,))
    with utils.track_saved_tensors(exclude=(model, inputs)) as saved:
        model(inputs)
    kept = {}
    for label in ("plain", "hooks"):
        with utils.measure_memory("cpu", include=(model, inputs)) as mem:
            if label == "hooks":
                logits, _ = _hooked_forward(recipe, model, lambda: model(inputs))
            else:
                logits = model(inputs)
        kept[label] = mem.end_bytes
        F.cross_entropy(logits, classes).backward()
    assert kept["plain"] - kept["hooks"] == saved.bytes // 2            # the notebook's claim, GELU saves each once


@pytest.mark.parametrize("dtype_case", ["fp32", "bf16 autocast"])
def test_bf16_hooks_leave_the_slices_of_a_fused_qkv_weight_alone(recipe, dtype_case):
    model = FusedQKVModel()
    tokens, _, labels = padded_tokens(3, 12, 64)
    reference = copy.deepcopy(model)
    autocast = torch.autocast("cpu", torch.bfloat16, enabled=dtype_case == "bf16 autocast")
    with autocast:
        logits, seen = _hooked_forward(recipe, model, lambda: model(tokens))
        want_logits = reference(tokens)
    F.cross_entropy(logits.float().flatten(0, 1), labels.flatten()).backward()
    F.cross_entropy(want_logits.float().flatten(0, 1), labels.flatten()).backward()
    assert any(is_weight for is_weight, _ in seen), "the forward saves views of the fused weight"
    assert not any(is_weight and packed for is_weight, packed in seen), "a weight view was packed as a bf16 copy"
    assert any(packed for _, packed in seen)                           # fp32 activations remain, under autocast too
    for (name, got), want in zip(model.named_parameters(), reference.parameters()):
        assert _relative(got.grad, want.grad) < 2 ** -6, name          # bf16's rounding of the activations only


def test_bf16_hooks_on_a_llama_pack_no_weight(recipe):
    pytest.importorskip("transformers")
    model = tiny_llama()
    input_ids, attention_mask, labels = padded_tokens(2, 10, 128)
    reference = copy.deepcopy(model)
    output, seen = _hooked_forward(recipe, model, lambda: model(input_ids, attention_mask=attention_mask, labels=labels))
    output.loss.backward()
    reference(input_ids, attention_mask=attention_mask, labels=labels).loss.backward()
    assert any(packed for _, packed in seen) and not any(w and p for w, p in seen)
    for (name, got), want in zip(model.named_parameters(), reference.parameters()):
        assert _relative(got.grad, want.grad) < 2 ** -5, name


def _head_case(model_name: str, dtype: torch.dtype):
    """(hidden (N, d) requiring grad, head weight (V, d), targets (N,) with -100 padding) from a reader's model."""
    if model_name == "llama":
        pytest.importorskip("transformers")
        model = tiny_llama(dtype)
        input_ids, attention_mask, labels = padded_tokens(3, 11, 128)
        hidden = model.model(input_ids, attention_mask=attention_mask).last_hidden_state
        weight, targets = model.lm_head.weight, labels
    elif model_name == "fused qkv":
        model = FusedQKVModel().to(dtype)
        tokens, _, labels = padded_tokens(3, 11, 64)
        hidden = model.embed(tokens)
        for layer in model.layers:
            hidden = layer(hidden)
        weight, targets = model.head.weight, labels
    else:
        model = sequential_mlp().to(dtype)
        inputs, targets = torch.randn(33, 16).to(dtype), torch.randint(0, 5, (33,))
        targets[::4] = -100
        hidden, weight = model[:-1](inputs), model[-1].weight          # the head without its bias (see the recipe)
    hidden = hidden.detach().flatten(0, -2).requires_grad_()
    return hidden, weight.detach().requires_grad_(), targets.flatten()


@pytest.mark.parametrize("model_name", ["sequential", "fused qkv", "llama"])
@pytest.mark.parametrize("case", ["fp32", "bf16 autocast over fp32", "bf16 model"])
def test_chunked_cross_entropy_equals_f_cross_entropy(recipe, model_name, case):
    hidden, weight, targets = _head_case(model_name, torch.bfloat16 if case == "bf16 model" else torch.float32)
    assert (targets == -100).any() and len(targets) % 4 != 0
    with torch.autocast("cpu", torch.bfloat16, enabled=case == "bf16 autocast over fp32"):
        want = F.cross_entropy(F.linear(hidden, weight).float(), targets)
        got = recipe["ChunkedCrossEntropy"].apply(hidden, weight, targets, 4)      # 4 divides no case's N
    want_grads = torch.autograd.grad(want, (hidden, weight))
    got_grads = torch.autograd.grad(got, (hidden, weight))
    tolerance = 1e-5 if case == "fp32" else 2 ** -6
    assert abs(got.item() - want.item()) <= tolerance * abs(want.item())
    for got_grad, want_grad in zip(got_grads, want_grads):
        assert got_grad.dtype == want_grad.dtype
        assert _relative(got_grad.float(), want_grad.float()) < tolerance


def test_chunked_cross_entropy_keeps_nothing_of_size_v_after_forward(recipe):
    hidden = torch.randn(37, 8, requires_grad=True)
    weight = torch.randn(1000, 8, requires_grad=True)
    targets = torch.randint(0, 1000, (37,))
    targets[30:] = -100
    with utils.measure_memory("cpu", include=(hidden, weight, targets)) as mem:
        loss = recipe["ChunkedCrossEntropy"].apply(hidden, weight, targets, 8)
    assert mem.end_bytes == 4 + 8                                      # the loss and the count of real tokens
    del loss


@pytest.mark.parametrize("model_name", ["sequential"])   # "fused qkv" passes too; each compile costs seconds
def test_train_with_budget_matches_an_eager_step(recipe, model_name):
    torch._dynamo.reset()
    if model_name == "sequential":
        model = sequential_mlp()
        inputs, targets = torch.randn(12, 16), torch.randint(0, 5, (12,))
        targets[::3] = -100
    else:
        model = FusedQKVModel()
        inputs, _, targets = padded_tokens(2, 9, 64)
    eager = copy.deepcopy(model)
    compiled = recipe["train_with_budget"](model, [(inputs, targets)], 0.0, backend="aot_eager_decomp_partition")
    model.load_state_dict(eager.state_dict())                          # the same weights: compare one step's gradients
    for net in (compiled, eager):                                      # the compiled step, budget 0, and plain eager
        F.cross_entropy(net(inputs).flatten(0, -2), targets.flatten()).backward()
    for (name, got), want in zip(model.named_parameters(), eager.parameters()):
        torch.testing.assert_close(got.grad, want.grad, rtol=1e-4, atol=1e-6, msg=name)
    torch._dynamo.reset()


@pytest.mark.parametrize("autocast_on", [False, True])
def test_the_utils_helper_is_the_recipe_with_a_bias(recipe, autocast_on):
    """utils.chunked_cross_entropy (notebook 08's text: 'this Function with an optional bias') agrees with the recipe
    on padded targets, under bf16 autocast over fp32 weights too."""
    hidden, weight, targets = _head_case("sequential", torch.float32)
    with torch.autocast("cpu", torch.bfloat16, enabled=autocast_on):
        want = recipe["ChunkedCrossEntropy"].apply(hidden, weight, targets, 4)
        got = utils.chunked_cross_entropy(hidden, weight, targets, chunk_size=4)
    want_grads = torch.autograd.grad(want, (hidden, weight))
    got_grads = torch.autograd.grad(got, (hidden, weight))
    assert abs(got.item() - want.item()) <= 1e-5 * abs(want.item())
    for got_grad, want_grad in zip(got_grads, want_grads):
        assert _relative(got_grad, want_grad) < 1e-4
