"""Notebook 17's recipe (``checkpoint_each``, ``build_recipe``, ``train_step``, ``make_scaler`` and the loss and
batch helpers), taken from the notebook's cells tagged ``recipe`` and run on models it was not written for: a
transformers Llama (bf16 autocast over fp32 weights, and a bf16 base) on right-padded batches given as a dict, an
``nn.Sequential``, and a model with a fused qkv weight. Each asserts the notebook's claims: the gradient handed to
the optimizer is the plain whole-batch gradient (to summation order in fp32, to 16-bit rounding under autocast)
however the batch divides and wherever the padding is; checkpointing keeps the state-dict keys; the step reads
the loss once (one sync); with a GradScaler forced on the gradient comes out unscaled and an overflow is skipped.
"""
from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from tests.recipe_models import FusedQKVModel, padded_tokens, run_recipe, sequential_mlp, tiny_llama

VOCAB, LENGTH, ROWS, PIECES = 64, 12, 7, 3          # 7 rows in 3 pieces: 3, 3 and 1
SETTINGS = {"AMP_DTYPE": torch.bfloat16, "DEVICE": torch.device("cpu"), "LEARNING_RATE": 1e-3,
            "COMPILE_BACKEND": "aot_eager"}


@pytest.fixture(scope="module")
def recipe() -> dict:
    return run_recipe("17", namespace=dict(SETTINGS))


def _flat_grad(model) -> torch.Tensor:
    return torch.cat([p.grad.flatten().float() for p in model.parameters()])


def _gradient_seen_by_optimizer(model, run_step) -> torch.Tensor:
    """What `run_step(optimizer)` hands its optimizer (an SGD with lr 0 reads it)."""
    caught = []
    probe = torch.optim.SGD(model.parameters(), lr=0.0)
    probe.register_step_pre_hook(lambda *_: caught.append(_flat_grad(model)))
    run_step(probe)
    assert len(caught) == 1, "the step must call optimizer.step() once"
    return caught[0]


def _relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm()).item()


def _llama_case(recipe, dtype):
    """A Llama, a padded dict batch, its own loss's gradient, and the recipe's loss and count for it."""
    input_ids, attention_mask, labels = padded_tokens(ROWS, LENGTH, VOCAB, seed=2)
    inputs = {"input_ids": input_ids, "attention_mask": attention_mask}
    plain = tiny_llama(dtype, vocab_size=VOCAB)
    plain.config.use_cache = False
    plain(**inputs, labels=labels).loss.backward()
    options = {"loss_sum": lambda outputs, labels: recipe["token_loss_sum"](outputs.logits[:, :-1], labels[:, 1:]),
               "count": lambda labels: recipe["count_targets"](labels[:, 1:])}
    return (lambda: _configured(tiny_llama(dtype, vocab_size=VOCAB))), (lambda m: m.model.layers), inputs, labels, \
        _flat_grad(plain), options


def _configured(model):
    model.config.use_cache = False            # the notebook's note: no KV cache under checkpointing
    return model


def _sequential_case(recipe):
    features = torch.randn(ROWS, 16, generator=torch.Generator().manual_seed(1))
    classes = torch.randint(0, 5, (ROWS,), generator=torch.Generator().manual_seed(2))
    plain = sequential_mlp()
    F.cross_entropy(plain(features), classes).backward()
    options = {"loss_sum": lambda logits, targets: F.cross_entropy(logits, targets, reduction="sum"),
               "count": lambda targets: torch.tensor(len(targets))}
    return sequential_mlp, (lambda m: list(m)), features, classes, _flat_grad(plain), options


def _fused_qkv_case(recipe):
    input_ids, _, labels = padded_tokens(ROWS, LENGTH, VOCAB, seed=3)
    plain = FusedQKVModel(vocab=VOCAB)
    F.cross_entropy(plain(input_ids).flatten(0, 1), labels.flatten(), ignore_index=-100).backward()
    return (lambda: FusedQKVModel(vocab=VOCAB)), (lambda m: m.layers), input_ids, labels, _flat_grad(plain), {}


CASES = ["llama, fp32 weights", "llama, bf16 autocast over fp32 weights", "llama, bf16 base",
         "sequential", "fused qkv, bf16 autocast"]


@pytest.mark.parametrize("case", CASES)
def test_the_step_hands_the_optimizer_the_plain_gradient(recipe, case: str) -> None:
    amp = torch.bfloat16 if "bf16" in case else torch.float32
    if case.startswith("llama"):
        build, blocks, inputs, targets, reference, options = _llama_case(
            recipe, torch.bfloat16 if "base" in case else torch.float32)
    elif case == "sequential":
        build, blocks, inputs, targets, reference, options = _sequential_case(recipe)
    else:
        build, blocks, inputs, targets, reference, options = _fused_qkv_case(recipe)
    model, _ = recipe["build_recipe"](build, checkpointed=True, blocks=blocks)
    gradient = _gradient_seen_by_optimizer(model, lambda probe: recipe["train_step"](
        model, probe, recipe["make_scaler"](amp), inputs, targets, PIECES, amp, **options))
    error = _relative(gradient, reference)
    # fp32: the same sums in another order, each entry a sum over at most ROWS * LENGTH terms; 16-bit: the format's
    # rounding (the notebook's GRADIENT_TOLERANCE); a bf16 base rounds the plain reference too, hence twice that
    tolerance = {torch.float32: ROWS * LENGTH * torch.finfo(torch.float32).eps,
                 torch.bfloat16: 2 * torch.finfo(torch.bfloat16).eps}[amp] * (2 if "base" in case else 1)
    assert error < tolerance, f"{case}: the recipe's gradient is {error:.2e} from the plain step's"
    assert all(p.grad is None for p in model.parameters()), "the step frees the gradients"


def test_checkpointing_keeps_the_state_dict_keys(recipe) -> None:
    plain = _configured(tiny_llama(vocab_size=VOCAB))
    model, _ = recipe["build_recipe"](lambda: _configured(tiny_llama(vocab_size=VOCAB)), checkpointed=True,
                                      blocks=lambda m: m.model.layers)
    assert list(model.state_dict()) == list(plain.state_dict())
    model.load_state_dict(plain.state_dict())                  # strict, both ways
    plain.load_state_dict(model.state_dict())


def test_the_step_syncs_once(recipe, monkeypatch) -> None:
    calls = []
    item = torch.Tensor.item
    monkeypatch.setattr(torch.Tensor, "item", lambda self: calls.append(1) or item(self))
    model, optimizer = recipe["build_recipe"](sequential_mlp, checkpointed=False)
    features, classes = torch.randn(8, 16), torch.randint(0, 5, (8,))
    recipe["train_step"](model, optimizer, recipe["make_scaler"](torch.bfloat16), features, classes, 4,
                         torch.bfloat16, loss_sum=lambda logits, t: F.cross_entropy(logits, t, reduction="sum"),
                         count=lambda t: torch.tensor(len(t)))
    assert len(calls) == 1, f"{len(calls)} host syncs in one step of 4 micro-batches"


def test_a_scaler_forced_on_unscales_and_skips_an_overflow(recipe) -> None:
    build, blocks, inputs, targets, reference, options = _sequential_case(recipe)
    model, _ = recipe["build_recipe"](build, checkpointed=False)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10, enabled=True)
    gradient = _gradient_seen_by_optimizer(model, lambda probe: recipe["train_step"](
        model, probe, scaler, inputs, targets, PIECES, torch.float32, **options))
    assert _relative(gradient, reference) < ROWS * torch.finfo(torch.float32).eps * 16

    class Overflowing(torch.amp.GradScaler):
        def step(self, optimizer, *args, **kwargs):
            next(p.grad for p in optimizer.param_groups[0]["params"] if p.grad is not None).view(-1)[0] = math.inf
            return super().step(optimizer, *args, **kwargs)

    model, optimizer = recipe["build_recipe"](build, checkpointed=False)
    weights = [p.detach().clone() for p in model.parameters()]
    recipe["train_step"](model, optimizer, Overflowing("cpu", init_scale=2.0**10), inputs, targets, PIECES,
                         torch.float32, **options)
    assert all(torch.equal(a, b) for a, b in zip(weights, model.parameters())), "an overflowing step was not skipped"
