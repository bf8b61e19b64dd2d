"""Notebook 03's recipe (`forward_checkpointed`, `checkpoint_blocks`, and the cell that keeps BatchNorm's running
statistics), taken from the notebook's cells tagged ``recipe``, run on the models a reader brings: an
``nn.Sequential``, a fused-qkv toy, transformers Llama (fp32, bf16 autocast, a bf16 base), Qwen2 (biases, tied head),
GPT-2 (``Conv1D``, dropout on), a bf16 Mistral with a sliding window, an ``nn.TransformerEncoder`` classifier with a
padding mask, and a conv net with BatchNorm. Each run asserts the notebook's claims: the gradients of the plain step
(to the bit on a CPU: the recomputation runs the same kernels on the same numbers, and restores the RNG for dropout),
each block's forward run twice, less kept for backward, state-dict keys unchanged, BatchNorm's running statistics and
``num_batches_tracked`` those of the plain step; and that a transformers model asked to keep its key/value cache while
training is refused with a message that names ``use_cache=False``, on every family."""
from __future__ import annotations

import copy

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

import utils
from tests.recipe_models import (CAUSAL_LM_FAMILIES, EncoderClassifier, FusedQKVModel, batchnorm_convnet,
                                 padded_dict_batches, padded_tokens, run_recipe, sequential_mlp, tiny_llama)


@pytest.fixture(scope="module")
def recipe():
    return run_recipe("03")


def _grads(model: nn.Module) -> torch.Tensor:
    return utils.flat_gradients(model, zero=True).float()


def _count_calls(modules) -> tuple[list[int], list]:
    calls = [0] * len(modules)
    handles = [m.register_forward_pre_hook(lambda module, args, i=i: calls.__setitem__(i, calls[i] + 1))
               for i, m in enumerate(modules)]
    return calls, handles


def _remove(handles) -> None:
    for handle in handles:
        handle.remove()


def test_every_recipe_cell_names_what_the_readers_script_must_define():
    from tests.recipe_models import recipe_cells
    for source in recipe_cells("03"):
        assert source.startswith("# Expects: "), source.splitlines()[0]


def test_forward_checkpointed_on_a_sequential(recipe):
    model = sequential_mlp()
    x, target = torch.randn(6, 16), torch.randint(0, 5, (6,))
    nn.functional.cross_entropy(model(x), target).backward()
    plain = _grads(model)
    calls, handles = _count_calls(list(model))
    nn.functional.cross_entropy(recipe["forward_checkpointed"](model, x), target).backward()
    _remove(handles)
    assert calls == [2] * len(model)
    torch.testing.assert_close(_grads(model), plain, rtol=1e-5, atol=1e-7)


def _fused_loss(model: FusedQKVModel, tokens, labels, forward_layers) -> torch.Tensor:
    logits = model.head(forward_layers(model.layers, model.embed(tokens)))
    return nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten())          # -100 is ignored


def test_forward_checkpointed_on_a_fused_qkv_model_with_padded_targets(recipe):
    model = FusedQKVModel()
    tokens, _, labels = padded_tokens(3, 10, 64)

    def plain_layers(layers, x):
        for layer in layers:
            x = layer(x)
        return x

    with utils.measure_memory("cpu", timeline=False, include=model) as plain_memory:
        loss = _fused_loss(model, tokens, labels, plain_layers)
    loss.backward()
    plain = _grads(model)
    calls, handles = _count_calls(list(model.layers))
    with utils.measure_memory("cpu", timeline=False, include=model) as checkpointed_memory:
        loss = _fused_loss(model, tokens, labels, recipe["forward_checkpointed"])
    loss.backward()
    _remove(handles)
    assert calls == [2, 2]
    torch.testing.assert_close(_grads(model), plain, rtol=1e-5, atol=1e-7)
    assert checkpointed_memory.end_bytes < plain_memory.end_bytes, "checkpointing keeps less for backward"


# (family, autocast): every decoder family, and Llama under bf16 autocast over fp32 weights and as a bf16 base
DECODER_CASES = [(family, False) for family in CAUSAL_LM_FAMILIES] + [("llama", True), ("llama-bf16-base", False)]


def _decoder(family: str) -> nn.Module:
    if family == "llama-bf16-base":
        return tiny_llama(torch.bfloat16).train()
    return CAUSAL_LM_FAMILIES[family]().train()          # GPT-2 with dropout on: the RNG is restored on recompute


def _layers(model: nn.Module) -> nn.ModuleList:
    return model.transformer.h if hasattr(model, "transformer") else model.model.layers


@pytest.mark.parametrize("family, autocast", DECODER_CASES, ids=[f + ("-autocast" if a else "") for f, a in DECODER_CASES])
def test_checkpoint_blocks_on_a_transformers_decoder(recipe, family, autocast):
    model = _decoder(family)
    batch = padded_dict_batches(batch_size=3, size=3)[0]          # right-padded rows, labels -100 on the padding

    def loss_of(m):                         # use_cache=False: a key/value cache would change on recompute
        torch.manual_seed(0)                # the same dropout masks in the plain and the checkpointed step
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            return m(**batch, use_cache=False).loss

    with utils.measure_memory("cpu", timeline=False, include=model) as plain_memory:
        loss = loss_of(model)
    loss.backward()
    plain = _grads(model)
    keys = list(model.state_dict())
    recipe["checkpoint_blocks"](_layers(model))
    calls, handles = _count_calls([layer.mlp for layer in _layers(model)])   # inner modules see the recompute
    with utils.measure_memory("cpu", timeline=False, include=model) as checkpointed_memory:
        loss = loss_of(model)
    loss.backward()
    _remove(handles)
    assert calls == [2] * len(_layers(model))
    torch.testing.assert_close(_grads(model), plain, rtol=0, atol=0)      # the same ops on the same numbers
    assert list(model.state_dict()) == keys, "state-dict keys unchanged: checkpoints load across the two"
    assert checkpointed_memory.end_bytes < plain_memory.end_bytes
    for layer in _layers(model):                                           # the documented undo
        del layer.forward
    calls, handles = _count_calls([layer.mlp for layer in _layers(model)])
    loss_of(model).backward()
    _remove(handles)
    assert calls == [1] * len(_layers(model))


@pytest.mark.parametrize("family", list(CAUSAL_LM_FAMILIES))
def test_checkpoint_blocks_refuses_the_cache_by_name_while_training_and_leaves_generation_alone(recipe, family):
    """Today's recipe fails on a shape mismatch that never names the cache (or GPT-2's, on none at all); the recipe
    says to pass use_cache=False. Without gradients (evaluation, generation) nothing is recomputed, and the cache works."""
    model = _decoder(family)
    batch = padded_dict_batches(batch_size=2, size=2)[0]
    recipe["checkpoint_blocks"](_layers(model))
    with pytest.raises(ValueError, match=r"use_cache=False.*model\.config\.use_cache = False"):
        model(**batch).loss.backward()                       # transformers' default: config.use_cache is True
    with pytest.raises(ValueError, match="use_cache=False"):
        model(**batch, use_cache=True)
    assert all(p.grad is None for p in model.parameters())
    model.eval()
    with torch.no_grad():                                    # a cache with no recomputation: allowed
        assert model(input_ids=batch["input_ids"], use_cache=True).logits.isfinite().all()
    model.train()
    model.config.use_cache = False                           # the other way the message offers
    model(**batch).loss.backward()
    assert all(p.grad is not None for p in model.parameters() if p.requires_grad)


def test_checkpoint_blocks_on_an_encoder_classifier_with_a_padding_mask(recipe):
    """nn.TransformerEncoder calls its layers with keyword masks (src_key_padding_mask): they pass through."""
    model = EncoderClassifier().train()
    batch = padded_dict_batches(batch_size=4, size=4, vocab=64)[0]
    labels = torch.tensor([0, 1, 2, 1])
    nn.functional.cross_entropy(model(batch["input_ids"], batch["attention_mask"]), labels).backward()
    plain = _grads(model)
    recipe["checkpoint_blocks"](model.encoder.layers)
    calls, handles = _count_calls([layer.linear1 for layer in model.encoder.layers])
    nn.functional.cross_entropy(model(batch["input_ids"], batch["attention_mask"]), labels).backward()
    _remove(handles)
    assert calls == [2, 2]
    torch.testing.assert_close(_grads(model), plain, rtol=0, atol=0)
    model.eval()                                             # the encoder's inference fast path still runs
    with torch.no_grad():
        assert model(batch["input_ids"], batch["attention_mask"]).isfinite().all()


def _bn_step(recipe, how: str) -> nn.Sequential:
    """One training step of the BatchNorm conv net, its two conv-BN-ReLU stages run `how`."""
    model = batchnorm_convnet()
    images = torch.randn(6, 3, 8, 8, generator=torch.Generator().manual_seed(1))
    labels = torch.tensor([0, 1, 2, 3, 4, 0])
    if how == "checkpoint_blocks":
        recipe["checkpoint_blocks"](model[:2])
    if how == "forward_checkpointed":
        logits = model[2:](recipe["forward_checkpointed"](model[:2], images))
    elif how == "checkpoint alone":
        hidden = images
        for stage in model[:2]:
            hidden = checkpoint(stage, hidden, use_reentrant=False)
        logits = model[2:](hidden)
    else:
        logits = model(images)
    nn.functional.cross_entropy(logits, labels).backward()
    return model


def _batchnorm_state(model: nn.Sequential) -> list[torch.Tensor]:
    return [buffer.clone() for stage in model[:2] for buffer in stage[1].buffers()]


def test_checkpoint_alone_counts_each_batch_twice_in_batchnorm_the_librarys_limitation(recipe):
    """What the notebook says beside the recipe: torch.utils.checkpoint reruns BatchNorm's forward as is."""
    plain, alone = _bn_step(recipe, "plain"), _bn_step(recipe, "checkpoint alone")
    assert int(alone[0][1].num_batches_tracked) == 2 and int(plain[0][1].num_batches_tracked) == 1
    assert not torch.equal(alone[0][1].running_mean, plain[0][1].running_mean)
    torch.testing.assert_close(_grads(alone), _grads(plain), rtol=0, atol=0)   # the gradients are right


@pytest.mark.parametrize("how", ["forward_checkpointed", "checkpoint_blocks"])
def test_the_recipe_keeps_batchnorms_running_statistics_those_of_the_plain_step(recipe, how):
    plain, checkpointed = _bn_step(recipe, "plain"), _bn_step(recipe, how)
    for stage in checkpointed[:2]:
        assert int(stage[1].num_batches_tracked) == 1, "one batch counted once"
    for got, want in zip(_batchnorm_state(checkpointed), _batchnorm_state(plain)):
        assert torch.equal(got, want), "running_mean, running_var and num_batches_tracked of the plain step"
    torch.testing.assert_close(_grads(checkpointed), _grads(plain), rtol=0, atol=0)
    checkpointed.eval(), plain.eval()                        # what the statistics are for: the evaluated model
    images = torch.randn(4, 3, 8, 8)
    with torch.no_grad():
        assert torch.equal(checkpointed(images), plain(images))


def test_checkpoint_blocks_on_copies_leaves_the_original_alone(recipe):
    model = FusedQKVModel()
    patched = copy.deepcopy(model)
    recipe["checkpoint_blocks"](patched.layers)
    assert "forward" not in vars(model.layers[0]) and "forward" in vars(patched.layers[0])
    twice = copy.deepcopy(patched)                           # a copy of a patched model checkpoints its own blocks
    calls, handles = _count_calls([layer.mlp for layer in twice.layers])
    twice(torch.randint(0, 64, (2, 5))).sum().backward()
    _remove(handles)
    assert calls == [2, 2] and all(p.grad is None for p in patched.parameters())
