"""Notebook 09's LoRA recipe (``LoRALinear``, ``add_lora``, ``merge_lora``), taken from the notebook's `recipe`
cells, on models the notebook was not written for: the transformers families of ``recipe_models`` (a Llama, a Qwen2
with biases and a tied head, GPT-2 with its ``Conv1D`` layers and dropout, a bf16 Mistral with a sliding window), in
fp32, as a bf16 base and under bf16 autocast over fp32 weights, with padded labels; an ``nn.Sequential``; a model with
a fused qkv weight that forward ``.split``s (it reads the wrapped layer's ``.weight`` itself); an
``nn.TransformerEncoder`` classifier with a padding mask, trained and then evaluated (its ``eval()`` fast path reads
``linear1.weight``); models with nothing to adapt; and held-out models (``recipe_models_heldout``) whose adapted
head is tied to the input embedding (BERT's masked-LM decoder, a reader's frozen tied ``out``).

Each run asserts the notebook's claims: the adapted model starts as the base model; only the adapters train, and
they number ``r · (in + out)`` per wrapped layer; a gradient step changes the output; merged, it computes what the
adapted model computes with the plain model's parameters; a model with nothing to adapt is refused, untouched.
"""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from tests.recipe_models import (CAUSAL_LM_FAMILIES, EncoderClassifier, FusedQKVModel, batchnorm_convnet, padded_tokens,
                                 run_recipe, sequential_mlp)

RANK = 4


@pytest.fixture(scope="module")
def recipe() -> dict:
    return run_recipe("09")


def _adaptable(module: nn.Module) -> bool:
    return isinstance(module, nn.Linear) or type(module).__name__ == "Conv1D"


def _in_out(module: nn.Module) -> tuple[int, int]:
    if isinstance(module, nn.Linear):
        return module.in_features, module.out_features
    return tuple(module.weight.shape)                                  # Conv1D: weight (in, out)


def _expected_trainable(model: nn.Module, skip: tuple[str, ...]) -> int:
    return sum(RANK * sum(_in_out(m)) for name, m in model.named_modules()
               if _adaptable(m) and name.rsplit(".", 1)[-1] not in skip)


def _loss(model: nn.Module, kind: str, batch) -> torch.Tensor:
    torch.manual_seed(0)                                               # GPT-2's dropout: the same masks every call
    if kind in CAUSAL_LM_FAMILIES:
        input_ids, attention_mask, labels = batch
        return model(input_ids, attention_mask=attention_mask, labels=labels).loss
    if kind == "encoder classifier":
        input_ids, attention_mask, classes = batch
        return F.cross_entropy(model(input_ids, attention_mask).float(), classes)
    inputs, targets = batch
    return F.cross_entropy(model(inputs).float().flatten(0, -2), targets.flatten())


def _case(kind: str, dtype: torch.dtype):
    """(model, batch, skip): the reader's model, a batch for it, and the names add_lora must leave alone."""
    if kind in CAUSAL_LM_FAMILIES:
        pytest.importorskip("transformers")
        return CAUSAL_LM_FAMILIES[kind](dtype=dtype), padded_tokens(3, 10, 128), ("lm_head",)
    if kind == "fused qkv":                                            # forward reads qkv.weight: the merged weight
        tokens, _, labels = padded_tokens(3, 10, 64)
        return FusedQKVModel().to(dtype), (tokens, labels), ("head",)
    if kind == "encoder classifier":                                   # nn.MultiheadAttention reads out_proj.weight
        input_ids, attention_mask, _ = padded_tokens(3, 9, 64)
        return EncoderClassifier().to(dtype), (input_ids, attention_mask, torch.tensor([0, 2, 1])), ("head",)
    targets = torch.randint(0, 5, (12,))
    targets[::4] = -100
    return sequential_mlp().to(dtype), (torch.randn(12, 16).to(dtype), targets), ("head",)


KINDS = ["sequential", "fused qkv", "encoder classifier", "llama", "qwen2", "gpt2"]
CASES = [(kind, case) for kind in KINDS for case in ["fp32", "bf16 base", "bf16 autocast over fp32"]]
CASES += [("mistral-bf16-sliding", "bf16 base")]


@pytest.mark.parametrize("kind, case", CASES)
def test_lora_starts_as_the_base_trains_and_merges(recipe, kind, case):
    model, batch, skip = _case(kind, torch.bfloat16 if case == "bf16 base" else torch.float32)
    base = copy.deepcopy(model)
    expected = _expected_trainable(model, skip)
    recipe["add_lora"](model, RANK, 16.0, skip=skip)
    adapters = [p for p in model.parameters() if p.requires_grad]
    assert expected > 0 and sum(p.numel() for p in adapters) == expected
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


def test_gpt2_conv1d_layers_are_adapted_not_skipped(recipe):
    """GPT-2's attention and MLP layers are transformers' Conv1D (weight (in, out)), not nn.Linear: every one of them
    gets an adapter of r · (in + out) parameters, and the merged weight keeps Conv1D's layout."""
    pytest.importorskip("transformers")
    model = CAUSAL_LM_FAMILIES["gpt2"]()
    conv1d = [name for name, m in model.named_modules() if type(m).__name__ == "Conv1D"]
    assert len(conv1d) == 4 * model.config.n_layer
    recipe["add_lora"](model, RANK)
    wrapped = {name for name, m in model.named_modules() if isinstance(m, recipe["LoRALinear"])}
    assert wrapped == set(conv1d)
    layer = model.get_submodule(conv1d[0])
    assert layer.weight.shape == layer.base.weight.shape                          # (in, out), as Conv1D stores it


@pytest.mark.parametrize("grad_enabled", [False, True])
def test_an_encoder_classifier_trains_then_evaluates_through_its_fast_path(recipe, grad_enabled):
    """nn.TransformerEncoderLayer in eval() under torch.no_grad() takes a fused path that reads linear1.weight and
    out_proj.weight itself; with the adapters those are the merged weights, so eval equals the merged model."""
    model, batch, skip = _case("encoder classifier", torch.float32)
    recipe["add_lora"](model, RANK, skip=skip)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    losses = []
    for _ in range(3):
        loss = _loss(model, "encoder classifier", batch)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
    assert losses[-1] < losses[0]
    model.eval()
    input_ids, attention_mask, _ = batch
    with torch.set_grad_enabled(grad_enabled):
        evaluated = model(input_ids, attention_mask)
    merged = recipe["merge_lora"](copy.deepcopy(model)).eval()
    with torch.no_grad():
        torch.testing.assert_close(evaluated.detach(), merged(input_ids, attention_mask), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("kind", ["a conv net with its Linear skipped", "every Linear named in skip"])
def test_nothing_to_adapt_is_refused_before_anything_is_frozen(recipe, kind):
    if kind == "a conv net with its Linear skipped":
        model, skip = batchnorm_convnet(), ("4",)
    else:
        model, skip = sequential_mlp(), ("0", "2", "4")
    before = [(name, p.requires_grad) for name, p in model.named_parameters()]
    with pytest.raises(ValueError, match=r"found no nn.Linear or Conv1D .* the model holds \[.*(Conv2d|Linear)"):
        recipe["add_lora"](model, RANK, skip=skip)
    assert [(name, p.requires_grad) for name, p in model.named_parameters()] == before, "the model was frozen anyway"


def test_fp32_adapters_on_a_bf16_base(recipe):
    layer = recipe["LoRALinear"](nn.Linear(8, 6).to(torch.bfloat16), RANK, dtype=torch.float32)
    assert layer.A.dtype == layer.B.dtype == torch.float32
    out = layer(torch.randn(5, 8, dtype=torch.bfloat16))
    assert out.dtype == torch.bfloat16                                           # the base's output dtype
    out.float().sum().backward()
    assert layer.B.grad.dtype == torch.float32 and layer.base.weight.grad is None


def test_the_merged_weight_a_model_reads_itself_has_the_adapters_gradients(recipe):
    """A forward that reads layer.weight (as a fused qkv .split does) computes with W + (alpha / rank) B A, and its
    gradients reach A and B as the chain rule says."""
    torch.manual_seed(0)
    layer = recipe["LoRALinear"](nn.Linear(8, 6), RANK)
    with torch.no_grad():
        layer.B.normal_()
    x = torch.randn(5, 8)
    called, read = layer(x), F.linear(x, layer.weight, layer.bias)
    torch.testing.assert_close(read, called, rtol=1e-5, atol=1e-6)
    grads_called = torch.autograd.grad(called.square().sum(), (layer.A, layer.B))
    grads_read = torch.autograd.grad(read.square().sum(), (layer.A, layer.B))
    for got, want in zip(grads_read, grads_called):
        torch.testing.assert_close(got, want)


def test_bad_ranks_raise(recipe):
    for rank in (0, 7, 2.0):
        with pytest.raises(ValueError, match="rank must be an int"):
            recipe["LoRALinear"](nn.Linear(8, 6), rank)


@pytest.mark.parametrize("family", ["bert masked LM", "frozen tied LM"])
def test_merging_a_head_tied_to_the_embedding_leaves_the_embedding_alone(recipe, family):
    """Held-out models (issue 38's paste test): a head that is the input embedding's matrix under another name than
    `skip`'s (BERT's `cls.predictions.decoder`, a reader's frozen `out`) is adapted; merging used to copy W + BA into
    that shared matrix, changing the embedding too: the merged logits were 11.5 (BERT) and 20.6 (the reader's LM) from
    the adapted model's. Merged, the model computes what the adapted one computes, and the embedding is unchanged."""
    from tests.recipe_models_heldout import FrozenTiedLM, left_padded, tiny_bert_mlm
    model = tiny_bert_mlm() if family == "bert masked LM" else FrozenTiedLM()
    embedding = model.get_input_embeddings().weight if family == "bert masked LM" else model.embed.weight
    head = model.cls.predictions.decoder if family == "bert masked LM" else model.out
    assert head.weight is embedding
    original = embedding.detach().clone()
    input_ids, attention_mask, _ = left_padded()
    inputs = {"input_ids": input_ids} | ({"attention_mask": attention_mask} if family == "bert masked LM" else {})
    def logits() -> torch.Tensor:
        output = model(**inputs)
        return output.logits if family == "bert masked LM" else output
    recipe["add_lora"](model, RANK)
    assert isinstance(head, nn.Linear) and any(m.base is head for m in model.modules()
                                               if isinstance(m, recipe["LoRALinear"]))
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, recipe["LoRALinear"]):
                module.B.normal_(0, 0.5)                     # as after training
        model.eval()
        adapted = logits()
        recipe["merge_lora"](model)
        merged = logits()
    assert torch.equal(embedding, original), "merging changed the input embedding"
    assert (merged - adapted).abs().max().item() <= 1e-4 * adapted.abs().max().item()
