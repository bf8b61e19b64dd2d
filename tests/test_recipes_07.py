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


def _check(attach, model, loss_of, steps=3, exact=True, make_optimizer=_adamw):
    normal = copy.deepcopy(model)
    normal_optimizer = make_optimizer([p for p in normal.parameters() if p.requires_grad])
    frozen = {name: p.detach().clone() for name, p in model.named_parameters() if not p.requires_grad}
    optimizers, handles = attach(model, make_optimizer)
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


# --- issue 38: every family the recipe applies to, and the two cases it refuses ------------------------------------

from tests.recipe_models import (CAUSAL_LM_FAMILIES, EncoderClassifier, batchnorm_convnet,  # noqa: E402
                                 padded_dict_batches)


def _seeded(loss_of):
    """The same dropout masks for the normal and the hooked model: the RNG is reset before each forward."""
    def seeded(model):
        torch.manual_seed(1)
        return loss_of(model)
    return seeded


@pytest.mark.parametrize("family", [name for name in CAUSAL_LM_FAMILIES if name != "llama"])
def test_causal_lm_families(attach, family):
    """Qwen2's tied head and biases, GPT-2's Conv1D and dropout, the bf16 Mistral with a sliding window."""
    model = CAUSAL_LM_FAMILIES[family]()
    batch = padded_dict_batches(2, size=2, max_length=10)[0]
    optimizers = _check(attach, model, _seeded(lambda m: m(**batch).loss))
    tied = [p for p in optimizers if p is model.get_output_embeddings().weight]
    if model.config.tie_word_embeddings:
        assert len(tied) == 1, "a tied head gets one optimizer and one hook"


def test_encoder_classifier_with_a_padding_mask(attach):
    batch = padded_dict_batches(2, size=2, vocab=64, max_length=10)[0]
    classes = torch.tensor([0, 2])
    _check(attach, EncoderClassifier(), lambda m: nn.functional.cross_entropy(
        m(batch["input_ids"], batch["attention_mask"]), classes))


def test_batchnorm_convnet_updates_its_running_statistics_once_per_step(attach):
    model = batchnorm_convnet()
    images, classes = torch.randn(2, 3, 6, 6), torch.tensor([1, 4])
    # its peak is in backward, where the activations dominate: the for-loop AdamW's temporaries, made inside backward
    # by the hooks, would outweigh the few gradients saved; fused AdamW (the notebook's) makes none
    _check(attach, model, lambda m: nn.functional.cross_entropy(m(images), classes),
           make_optimizer=lambda params: torch.optim.AdamW(params, lr=1e-2, fused=True))
    assert int(model[0][1].num_batches_tracked) == 3, "one forward per step: the hooks run no extra forward"


def test_a_fully_frozen_model_is_refused_with_a_message(attach):
    model = sequential_mlp().requires_grad_(False)
    with pytest.raises(ValueError, match="no parameter that requires grad"):
        attach(model, _adamw)


def test_an_fp16_grad_scaler_is_refused_and_says_what_to_do(attach):
    """Under an enabled scaler the hooks would step on scaled gradients (shown here: the update differs from the
    unscaled one), so the recipe refuses it and names bf16 and the normal loop; a disabled scaler passes through."""
    model = sequential_mlp()
    with pytest.raises(ValueError, match="GradScaler.*bf16 autocast.*scaler.step"):
        attach(model, _adamw, scaler=torch.amp.GradScaler("cpu", init_scale=2.0**16))
    optimizers, handles = attach(model, _adamw, scaler=torch.amp.GradScaler("cpu", enabled=False))
    assert len(optimizers) == len(list(model.parameters()))
    for handle in handles:
        handle.remove()
    # why: what the hooks would do under the scaler, stepping SGD on scaled gradients
    x, target = torch.randn(4, 16), torch.randint(0, 5, (4,))
    plain, scaled = copy.deepcopy(model), copy.deepcopy(model)
    def sgd_in_backward(param):
        with torch.no_grad():
            param.add_(param.grad, alpha=-1e-3)
        param.grad = None

    for copy_, scale in ((plain, 1.0), (scaled, 2.0**16)):
        for p in copy_.parameters():
            p.register_post_accumulate_grad_hook(sgd_in_backward)
        (nn.functional.cross_entropy(copy_(x), target) * scale).backward()
    assert not all(torch.allclose(p, q) for p, q in zip(plain.parameters(), scaled.parameters()))
