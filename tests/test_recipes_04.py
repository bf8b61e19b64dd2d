"""Notebook 04's recipe (`train`: autocast around the forward and the loss, the GradScaler around backward and the
step, clipping after `unscale_`), taken from the notebook's cell tagged ``recipe``, run on models it was not
written for: an ``nn.Sequential``, a fused-qkv model and a transformers Llama with padded labels, in fp32, under
bf16 autocast over fp32 weights, on a bf16 base, and in fp16 with the scaler forced on."""
from __future__ import annotations

import copy
import math

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


# --- issue 38: the shifted causal-LM loss, every family the recipe applies to, dict inputs -------------------------

from tests.recipe_models import (CAUSAL_LM_FAMILIES, EncoderClassifier, batchnorm_convnet,  # noqa: E402
                                 padded_dict_batches, recipe_cells)


@pytest.fixture(scope="module")
def recipe():
    return run_recipe("04")


def _split(batch: dict) -> tuple[dict, torch.Tensor]:
    """A DataLoader's dict batch as the recipe takes it: (the model's inputs, the labels)."""
    return {key: value for key, value in batch.items() if key != "labels"}, batch["labels"]


@pytest.mark.parametrize("family", list(CAUSAL_LM_FAMILIES))
def test_causal_lm_loss_equals_the_models_own_loss_on_padded_batches(recipe, family):
    """The loss the notebook suggests for a transformers model is the one ``model(..., labels=labels)`` computes:
    logits at t against the label at t + 1, padding skipped. The unshifted loss (the old suggestion) is not."""
    model = CAUSAL_LM_FAMILIES[family]().eval()                 # eval: GPT-2's dropout off, both calls alike
    for batch in padded_dict_batches(4, size=10):
        inputs, labels = _split(batch)
        assert (labels == -100).any(), "a padded batch"
        with torch.no_grad():
            output = model(**inputs)
            expected = model(**batch).loss
            suggested = recipe["causal_lm_loss"](output, labels)
            unshifted = nn.functional.cross_entropy(output.logits.float().flatten(0, 1), labels.flatten())
        assert suggested.dtype == torch.float32
        torch.testing.assert_close(suggested, expected, rtol=4 * torch.finfo(torch.float32).eps, atol=0)
        assert abs(float(unshifted - expected)) > 1e-3, "the unshifted loss differs visibly"


def _family_case(name: str):
    """(model, batches of (inputs, labels), loss_fn, autocast dtype) for each family the recipe applies to."""
    if name in CAUSAL_LM_FAMILIES:
        model = CAUSAL_LM_FAMILIES[name]()                      # GPT-2 keeps its dropout on: training mode
        return model, [_split(b) for b in padded_dict_batches(4, size=8)] * 3, "causal_lm_loss", torch.bfloat16
    if name == "encoder":
        batches = [_split(b) for b in padded_dict_batches(4, size=8, vocab=64)]
        batches = [(inputs, torch.arange(len(labels)) % 3) for inputs, labels in batches] * 4
        return EncoderClassifier(), batches, None, torch.bfloat16
    generator = torch.Generator().manual_seed(0)
    images = torch.randn(8, 3, 8, 8, generator=generator)
    return batchnorm_convnet(), [(images, torch.randint(0, 5, (8,), generator=generator))] * 10, None, torch.bfloat16


@pytest.mark.parametrize("name", [*CAUSAL_LM_FAMILIES, "encoder", "batchnorm_convnet"])
def test_train_runs_every_family_under_bf16_autocast(recipe, name):
    model, batches, loss_name, dtype = _family_case(name)
    stored = {p.dtype for p in model.parameters()}
    loss_fn = recipe[loss_name] if loss_name else nn.functional.cross_entropy
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    losses = recipe["train"](model, optimizer, _scaler(dtype), batches, dtype, loss_fn=loss_fn)
    assert all(math.isfinite(loss) for loss in losses) and len(losses) == len(batches)
    assert min(losses[-3:]) < losses[0], f"{name}: the loss did not fall"
    assert {p.dtype for p in model.parameters()} == stored, "autocast does not change the stored weights"


def test_train_takes_dict_inputs_as_the_models_keyword_arguments(recipe):
    """A dict of inputs reaches the model as keyword arguments (the attention mask included), not as one tensor."""
    seen = []

    class Probe(nn.Module):
        def __init__(self):
            super().__init__()
            self.linear = nn.Linear(4, 3)

        def forward(self, input_ids, attention_mask):
            seen.append(attention_mask)
            return self.linear(input_ids.float())

    model, mask = Probe(), torch.ones(2, 4)
    recipe["train"](model, torch.optim.SGD(model.parameters(), lr=0.1), _scaler(None),
                    [({"input_ids": torch.ones(2, 4), "attention_mask": mask}, torch.tensor([0, 1]))], None)
    assert len(seen) == 1 and seen[0] is mask


@pytest.mark.parametrize("prefix", ["04", "05", "06", "07"])
def test_every_recipe_cell_names_what_it_expects_from_the_readers_script(prefix):
    for source in recipe_cells(prefix):
        first = source.splitlines()[0]
        assert first.startswith("# Expects from your script:"), f"{prefix}: a recipe cell starts with {first!r}"


# --- issue 45: the format probe sizes the 16-bit sections (a fake slow probe, PYTORCH_INTRO_FORMAT_SLOWDOWN) ---------

def _sized_04(monkeypatch, tmp_path, slowdown: str) -> tuple[dict, str]:
    import contextlib
    import io
    import json as json_module

    from tests.recipe_models import notebook_path
    monkeypatch.setenv("PYTORCH_INTRO_CHECK_MODE", "0")                # the full lesson's sizes
    monkeypatch.setenv("PYTORCH_INTRO_BUILD_DIR", str(tmp_path))
    monkeypatch.setenv("PYTORCH_INTRO_FORMAT_SLOWDOWN", slowdown)
    cells = [c for c in json_module.loads(notebook_path("04").read_text())["cells"] if c["cell_type"] == "code"]
    namespace, printed = {}, io.StringIO()
    with contextlib.redirect_stdout(printed):
        for cell in cells[:3]:                                         # parameters, set-up, the probe
            exec("".join(cell["source"]), namespace)
    return namespace, printed.getvalue()


def test_a_slow_16_bit_format_cuts_the_sections_that_compute_in_it(monkeypatch, tmp_path):
    namespace, printed = _sized_04(monkeypatch, tmp_path, "bfloat16=40,float16=40")
    assert namespace["full_sizes"] == {"BATCH_SIZE": 2048, "HIDDEN_FEATURES": 512, "IN_FEATURES": 256,
                                       "TRAIN_STEPS": 100, "RECIPE_STEPS": 20, "SCALER_STEPS": 40}
    assert namespace["sized"] == {"BATCH_SIZE": 512, "HIDDEN_FEATURES": 128, "IN_FEATURES": 64, "TRAIN_STEPS": 30,
                                  "RECIPE_STEPS": 5, "SCALER_STEPS": 24}, "each held at the size its assertions need"
    assert namespace["BATCH_SIZE"] >= 4 * namespace["HIDDEN_FEATURES"], "rows still outweigh the weight copies"
    assert "bf16 matmuls take 40.0x fp32's time" in printed and "faked" in printed
    assert "sizes cut for the slow format" in printed and "BATCH_SIZE 2048 -> 512" in printed


def test_a_moderately_slow_format_is_cut_in_proportion(monkeypatch, tmp_path):
    namespace, _ = _sized_04(monkeypatch, tmp_path, "bfloat16=6,float16=2")       # the slower format decides
    assert namespace["sized"]["BATCH_SIZE"] == 1024 and namespace["sized"]["HIDDEN_FEATURES"] == 256
    assert namespace["sized"]["IN_FEATURES"] == 128
    assert namespace["sized"]["TRAIN_STEPS"] == 50


def test_native_formats_keep_every_size(monkeypatch, tmp_path):
    namespace, printed = _sized_04(monkeypatch, tmp_path, "bfloat16=0.5,float16=1.0")
    assert namespace["sized"] == namespace["full_sizes"] and "every section keeps its full size" in printed


@pytest.mark.parametrize("slowdown", ["bfloat16=40,float16=40", "bfloat16=6,float16=2", "bfloat16=3,float16=3"])
def test_the_cut_sizes_keep_section_5s_memory_prediction_below_its_threshold(monkeypatch, tmp_path, slowdown):
    """Section 5 asserts bf16 autocast keeps under 0.75x fp32's bytes after forward: the activations halve, and the
    cast input and weight copies come on top. Its prediction (exact on a CPU) holds at every size the probe picks."""
    from torch import nn as torch_nn
    namespace, _ = _sized_04(monkeypatch, tmp_path, slowdown)
    batch, hidden, width, layers = (namespace[name] for name in ("BATCH_SIZE", "HIDDEN_FEATURES", "IN_FEATURES",
                                                                 "NUM_HIDDEN_LAYERS"))
    with torch.device("meta"):
        model = namespace["utils"].MLP(width, hidden, 1, layers)
    parameters = sum(p.numel() for p in model.parameters())
    fp32 = layers * batch * hidden * 4 + batch * 4
    bf16 = layers * batch * hidden * 2 + batch * 2 + batch * width * 2 + parameters * 2
    assert bf16 / fp32 < 0.72, (slowdown, bf16 / fp32)
    assert isinstance(model, torch_nn.Module)
