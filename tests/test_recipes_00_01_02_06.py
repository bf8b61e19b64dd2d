"""Portability of the recipes of notebooks 00, 01, 02 and 06 (issue 28).

Each test takes the notebook's own recipe cells (tagged ``recipe``) with ``recipe_models.run_recipe``, never a
copy, and runs them on models the notebook was not written for: a transformers Llama built from a config
(padded targets, fp32, a bf16 base, bf16 autocast over fp32 weights), an ``nn.Sequential``, and a model with a
fused qkv weight. Each asserts the notebook's own claim: 00, the loop's timings and, through a fake of
``torch.cuda``, its CUDA calls and peaks; 01, the counted state equals the exact CPU tracker's bytes; 02, the
accumulated gradient equals one full-batch backward (an uneven last batch and padding included), where ``loss / N``
does not; 06, the profiled step updates as a plain step does, its four ranges are in the profile, and it never
asks for ``non_blocking`` from unpinned memory.
"""
from __future__ import annotations

import statistics

import pytest
import torch
from torch import nn

import utils
from fake_cuda import FakeCuda
from recipe_models import (CAUSAL_LM_FAMILIES, EncoderClassifier, FusedQKVModel, batchnorm_convnet,
                           padded_dict_batches, padded_tokens, recipe_cells, run_recipe, sequential_mlp,
                           tiny_llama)

FP32_EPS = torch.finfo(torch.float32).eps
BF16_EPS = torch.finfo(torch.bfloat16).eps


class LogitsOf(nn.Module):
    """A transformers causal LM as a reader passes it to a recipe: ids (B, T) -> logits (B, T - 1, vocab), aligned
    with ``labels[:, 1:]`` (the shift the model's own loss makes)."""

    def __init__(self, language_model: nn.Module) -> None:
        super().__init__()
        self.language_model = language_model

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.language_model(input_ids).logits[:, :-1]


def _model(name: str) -> nn.Module:
    """The reader's model of one case."""
    if name == "sequential":
        return sequential_mlp()
    if name == "fused_qkv":
        return FusedQKVModel(vocab=64)
    return LogitsOf(tiny_llama(torch.bfloat16 if name == "llama_bf16" else torch.float32, tie=name == "llama_tied"))


def _data(name: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(inputs, labels) of one case: an uneven batch of 65 for the classifier (4 pieces of 17, 17, 17, 14), and
    right-padded token batches (labels -100 on the padding) for the language models."""
    if name == "sequential":
        generator = torch.Generator().manual_seed(1)
        return torch.randn(65, 16, generator=generator), torch.randint(0, 5, (65,), generator=generator)
    if name == "fused_qkv":                  # next-token targets: labels equal to the inputs are refused
        input_ids, _, labels = padded_tokens(9, 12, 64, seed=2)
        return input_ids[:, :-1], labels[:, 1:]
    input_ids, _, labels = padded_tokens(13, 12, 128, seed=3)
    return input_ids, labels[:, 1:]


def _case(name: str):
    """(model, inputs, labels) for one reader's case."""
    return (_model(name), *_data(name))


def _loss(model: nn.Module, inputs: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    logits = model(inputs)
    return nn.functional.cross_entropy(logits.flatten(0, -2).float(), labels.flatten())


def _flat_grads(model: nn.Module) -> torch.Tensor:
    flat = torch.cat([p.grad.float().flatten() for p in model.parameters() if p.grad is not None])
    model.zero_grad(set_to_none=True)
    return flat


CASES = ["sequential", "fused_qkv", "llama", "llama_bf16", "llama_autocast"]


# --- the reader's families, as a training step sees them ------------------------------------------------------

# every family a step-level recipe (00's loop, 01's count) applies to: the course's older cases and issue 38's
FAMILIES = ["sequential", "fused_qkv", "llama_bf16", "llama_tied", "llama_autocast", *CAUSAL_LM_FAMILIES, "encoder",
            "batchnorm_convnet"]


def _family_step_case(name: str):
    """(build_model, batches, loss_of(model, batch)) of one family: transformers decoders take the dict batches of a
    DataLoader (labels inside: the model's own loss); the encoder classifier a tuple (input_ids, attention_mask,
    labels); the conv net images; the older cases their (inputs, labels)."""
    if name in CAUSAL_LM_FAMILIES:
        return (lambda: CAUSAL_LM_FAMILIES[name]().train(), padded_dict_batches(batch_size=4, size=8),
                lambda model, batch: model(**batch).loss)
    if name == "encoder":
        batches = [(b["input_ids"], b["attention_mask"], torch.arange(len(b["input_ids"])) % 3)
                   for b in padded_dict_batches(batch_size=4, size=8, vocab=64)]
        return (lambda: EncoderClassifier().train(), batches,
                lambda model, batch: nn.functional.cross_entropy(model(batch[0], batch[1]), batch[2]))
    if name == "batchnorm_convnet":
        generator = torch.Generator().manual_seed(0)
        batches = [(torch.randn(6, 3, 8, 8, generator=generator), torch.arange(6) % 5) for _ in range(2)]
        return lambda: batchnorm_convnet().train(), batches, lambda model, batch: _loss(model, *batch)
    return lambda: _model(name), [_data(name)] * 2, lambda model, batch: _loss(model, *batch)


def test_every_recipe_cell_names_what_the_readers_script_must_define():
    for prefix in ("00", "01", "02"):
        for source in recipe_cells(prefix):
            assert source.startswith("# Expects: "), f"{prefix}: {source.splitlines()[0]}"


# --- 00: the measured training loop ---------------------------------------------------------------------

@pytest.mark.parametrize("name", [n for n in FAMILIES if n not in ("llama_bf16", "llama_tied", "llama_autocast")])
def test_00_measure_steps_times_every_step_of_a_readers_model(name):
    recipe = run_recipe("00")
    build_model, batches, loss_of = _family_step_case(name)
    model = build_model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    before = [p.detach().clone() for p in model.parameters()]
    seen = []

    def train_step(*args, **kwargs):
        batch = kwargs if kwargs else args              # a dict batch arrives as keywords, a tuple as positions
        seen.append(type(batch))
        loss_of(model, batch).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    steps = (batches * 2)[:4]
    step_ms, step_peak_bytes, median_ms = recipe["measure_steps"](train_step, steps, torch.device("cpu"), 2)
    assert len(step_ms) == 4 and all(ms > 0 for ms in step_ms)
    assert median_ms == statistics.median(step_ms[2:]), "the median leaves the warm-up steps out"
    assert step_peak_bytes == [], "a CPU has no allocator statistics: the recipe only times there"
    assert seen == [dict if isinstance(b, dict) else tuple for b in steps], "dicts as keywords, tuples as positions"
    assert any(not torch.equal(b, p) for b, p in zip(before, model.parameters())), "every step ran and trained"


def test_00_measure_steps_on_cuda_synchronises_and_reads_each_steps_peak(monkeypatch):
    fake = FakeCuda(device_count=1).install(monkeypatch)
    recipe = run_recipe("00")
    model = sequential_mlp()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    gradient_bytes = sum(p.nbytes for p in model.parameters())
    inputs, labels = torch.randn(32, 16), torch.randint(0, 5, (32,))

    def train_step(step_inputs, step_labels):
        _loss(model, step_inputs, step_labels).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    with fake.mirror():                       # every CPU tensor the step makes is a block on the fake card
        step_ms, step_peak_bytes, _ = recipe["measure_steps"](train_step, [(inputs, labels)] * 3,
                                                              torch.device("cuda"), 1)
    assert len(step_peak_bytes) == len(step_ms) == 3
    assert all(peak >= gradient_bytes for peak in step_peak_bytes), "each step's peak holds its gradients"
    names = [name for name, *_ in fake.calls if name in ("synchronize", "reset_peak_memory_stats",
                                                         "memory_allocated", "max_memory_allocated")]
    assert names == ["synchronize", "reset_peak_memory_stats", "memory_allocated", "synchronize",
                     "max_memory_allocated"] * 3, "synchronise, reset, read; step; synchronise, read the peak"


# --- 01: counting the training state --------------------------------------------------------------------

@pytest.mark.parametrize("name", FAMILIES)
def test_01_state_bytes_equals_the_exact_tracker_on_a_readers_model(name):
    state_bytes = run_recipe("01")["state_bytes"]
    build_model, batches, loss_of = _family_step_case(name)
    with utils.measure_memory("cpu") as built:
        model = build_model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    buffer_bytes = sum(b.nbytes for b in model.buffers())           # rotary tables, BatchNorm's statistics: not state
    counted_before = state_bytes(model, optimizer)
    assert counted_before["weights"] == built.end_bytes - buffer_bytes, "tied weights count once, as stored"
    with utils.measure_memory("cpu", include=model) as backward:
        with torch.autocast("cpu", torch.bfloat16, enabled=name == "llama_autocast"):
            loss_of(model, batches[0]).backward()
    with utils.measure_memory("cpu", include=[model, optimizer]) as step:
        optimizer.step()
    counted = state_bytes(model, optimizer)
    assert counted["gradients"] == backward.end_bytes and counted["optimizer"] == step.end_bytes
    assert counted_before["optimizer"] == 0 < counted["optimizer"]


# --- 02: accumulation ----------------------------------------------------------------------------------

@pytest.mark.parametrize("name", CASES)
def test_02_accumulated_gradient_equals_the_full_batch_where_loss_over_n_does_not(name):
    accumulate_gradients = run_recipe("02")["accumulate_gradients"]
    model, inputs, labels = _case(name)
    autocast = torch.autocast("cpu", torch.bfloat16, enabled=name == "llama_autocast")
    with autocast:
        _loss(model, inputs, labels).backward()
        full = _flat_grads(model)
        batch_loss = accumulate_gradients(model, inputs, labels, 4)
        accumulated = _flat_grads(model)
        for micro_inputs, micro_labels in zip(inputs.chunk(4), labels.chunk(4)):   # the old recipe: loss / N
            (_loss(model, micro_inputs, micro_labels) / 4).backward()
        over_n = _flat_grads(model)
    assert len(inputs.chunk(4)[-1]) != len(inputs.chunk(4)[0]) or (labels == -100).any(), "an uneven case"
    targets = int((labels != -100).sum())
    if name in ("llama_bf16", "llama_autocast"):
        # 16-bit arithmetic: a bf16 base also rounds .grad to bf16 at every micro-batch (the inherent limitation
        # the notebook states); four additions and the products' rounding stay within a few bf16 epsilons
        tolerance = 4 * BF16_EPS
    else:
        tolerance = 8 * targets ** 0.5 * FP32_EPS      # the notebook's fp32_rounding_bound over the targets
    error = float((accumulated - full).norm() / full.norm())
    assert error < tolerance, f"{name}: accumulated gradient off by {error:.2e} (allowed {tolerance:.1e})"
    assert float((over_n - full).norm() / full.norm()) > tolerance, "loss / N must be visibly biased here"
    with torch.no_grad(), autocast:
        assert abs(float(batch_loss) - float(_loss(model, inputs, labels))) < 0.02 * float(batch_loss)



def _causal_lm(family: str) -> nn.Module:
    """A reader's causal LM of ``family``, with dropout off where it has any (dropout draws other masks per micro-batch:
    section 5's other case, not this claim)."""
    extra = {"dropout": 0.0} if family == "gpt2" else {}
    return CAUSAL_LM_FAMILIES[family](**extra).train()


def _shifted(labels: torch.Tensor) -> torch.Tensor:
    """The labels as a causal LM's own loss shifts them: position t predicts token t + 1, the last predicts nothing."""
    return nn.functional.pad(labels, (0, 1), value=-100)[:, 1:]


@pytest.mark.parametrize("family", list(CAUSAL_LM_FAMILIES))
def test_02_takes_a_dataloaders_dict_batches_and_matches_transformers_own_full_batch_loss(family):
    """The reader's loop: dict batches of a DataLoader with a padding collator (rows of different lengths, the last
    batch shorter), labels taken out and shifted, `model(**micro_batch)`; the gradient is that of transformers' own
    loss over the whole batch, where dividing each micro-batch's mean by N is not."""
    recipe = run_recipe("02")
    model = _causal_lm(family)
    bf16 = next(model.parameters()).dtype == torch.bfloat16
    tolerance = 4 * BF16_EPS if bf16 else None
    for batch in padded_dict_batches(batch_size=5, size=13):
        model(**batch).loss.backward()                       # transformers' own loss: mean over the shifted targets
        full = _flat_grads(model)
        inputs = {name: value for name, value in batch.items() if name != "labels"}
        labels = _shifted(batch["labels"])
        batch_loss = recipe["accumulate_gradients"](model, inputs, labels, 2)
        accumulated = _flat_grads(model)
        error = float((accumulated - full).norm() / full.norm())
        allowed = tolerance or 8 * int((labels != -100).sum()) ** 0.5 * FP32_EPS
        assert error < allowed, f"{family}: accumulated gradient off by {error:.2e} (allowed {allowed:.1e})"
        with torch.no_grad():
            assert abs(float(batch_loss) - float(model(**batch).loss)) < (0.02 if bf16 else 1e-4) * float(batch_loss)
        if not bf16:                                         # the old recipe, mean / N, is biased on padded rows
            for piece in recipe["split_batch"](batch, len(labels), 2):
                (model(**piece).loss / 2).backward()
            over_n = _flat_grads(model)
            assert float((over_n - full).norm() / full.norm()) > allowed, "padding must make mean / N visibly biased"


def test_02_takes_a_tuple_batch_for_an_encoder_classifier_with_a_padding_mask():
    """`model(*micro_batch)`: an nn.TransformerEncoder classifier called as model(input_ids, attention_mask), labels
    (b,) with two samples ignored (-100): the gradient of one full-batch backward."""
    recipe = run_recipe("02")
    model = EncoderClassifier().train()
    batch = padded_dict_batches(batch_size=7, size=7, vocab=64)[0]
    labels = torch.tensor([0, 2, -100, 1, 1, -100, 2])
    nn.functional.cross_entropy(model(batch["input_ids"], batch["attention_mask"]), labels).backward()
    full = _flat_grads(model)
    recipe["accumulate_gradients"](model, (batch["input_ids"], batch["attention_mask"]), labels, 3)   # 3, 3, 1 rows
    error = float((_flat_grads(model) - full).norm() / full.norm())
    assert error < 8 * 5 ** 0.5 * FP32_EPS * 4, f"encoder: accumulated gradient off by {error:.2e}"


def test_02_on_a_batchnorm_convnet_runs_and_differs_from_the_full_batch_as_section_5_says():
    recipe = run_recipe("02")
    model = batchnorm_convnet()
    images, labels = torch.randn(16, 3, 8, 8, generator=torch.Generator().manual_seed(0)), torch.arange(16) % 5
    nn.functional.cross_entropy(model(images), labels).backward()
    full = _flat_grads(model)
    recipe["accumulate_gradients"](model, images, labels, 4)
    assert float((_flat_grads(model) - full).norm() / full.norm()) > 1e-3, "BatchNorm's statistics differ per piece"


def test_02_refuses_what_it_cannot_weight_with_a_message_that_names_it():
    recipe = run_recipe("02")
    model = _causal_lm("llama")
    batch = padded_dict_batches(batch_size=4, size=4)[0]
    inputs = {name: value for name, value in batch.items() if name != "labels"}
    with pytest.raises(ValueError, match="line up with labels .*shift"):           # labels[:, 1:] without the pad
        recipe["accumulate_gradients"](model, inputs, batch["labels"][:, 1:], 2)
    with pytest.raises(ValueError, match="4 rows"):                                # a (1, T) tensor is not split by row
        recipe["accumulate_gradients"](model, {**inputs, "position_ids": torch.arange(batch["input_ids"].shape[1])[None]},
                                       _shifted(batch["labels"]), 2)
    with pytest.raises(ValueError, match="every label is padding"):
        recipe["accumulate_gradients"](model, inputs, torch.full_like(batch["labels"], -100), 2)
    assert all(p.grad is None for p in model.parameters()), "a refused batch leaves no gradient behind"


def test_02_refuses_a_collators_unshifted_causal_lm_labels_and_trains_a_masked_lm():
    """``DataCollatorForLanguageModeling(mlm=False)`` copies input_ids into labels (padded_dict_batches' labels are
    those): they line up with the logits, and a loss outside the model trains each position to repeat its own token
    (the gradient was 1.33 off, relative, before the recipe refused them). A masked LM's labels, masked in input_ids,
    pass and give the model's own loss gradient."""
    from recipe_models_heldout import VOCAB, tiny_bert_mlm

    recipe = run_recipe("02")
    model = _causal_lm("llama")
    batch = padded_dict_batches(batch_size=4, size=4)[0]
    inputs = {name: value for name, value in batch.items() if name != "labels"}
    with pytest.raises(ValueError, match="causal LM.s unshifted labels"):
        recipe["accumulate_gradients"](model, inputs, batch["labels"], 2)
    assert all(p.grad is None for p in model.parameters()), "a refused batch leaves no gradient behind"
    recipe["accumulate_gradients"](model, inputs, _shifted(batch["labels"]), 2)        # shifted: trained
    count_targets = recipe["count_targets"]
    tokens, mask, labels = batch["input_ids"], batch["attention_mask"], batch["labels"]
    for unshifted in [(tokens, mask), tokens, labels, {"input_ids": tokens.clone(), "attention_mask": mask}]:
        with pytest.raises(ValueError, match="causal LM.s unshifted labels"):         # a tuple's or a tensor's tokens too
            count_targets(unshifted, labels)
    shifted = _shifted(labels)
    assert count_targets((tokens, mask), shifted) == count_targets(batch, shifted) == (shifted != -100).sum()
    assert count_targets({**inputs, "labels": shifted}, shifted) == (shifted != -100).sum()   # the labels' own key

    mlm = tiny_bert_mlm()
    tokens = padded_dict_batches(batch_size=4, size=4, vocab=VOCAB - 1)[0]
    real = tokens["attention_mask"].bool()
    masked = real & (torch.rand(real.shape, generator=torch.Generator().manual_seed(0)) < 0.3)
    masked[0, 0] = masked[1, 1] = True                                      # two targets at least
    replaced = masked.clone()
    replaced[0, 0] = False                          # the collator's 10 % left unchanged: this target is its own input
    labels = torch.where(masked, tokens["input_ids"], -100)
    masked_inputs = {"input_ids": torch.where(replaced, VOCAB - 1, tokens["input_ids"]),     # VOCAB - 1: the [MASK]
                     "attention_mask": tokens["attention_mask"]}
    mlm(**masked_inputs, labels=labels).loss.backward()                      # transformers' own: mean over targets
    expected = _flat_grads(mlm)
    mlm.zero_grad(set_to_none=True)
    recipe["accumulate_gradients"](mlm, masked_inputs, labels, 2)
    assert float((_flat_grads(mlm) - expected).norm() / expected.norm()) < 1e-5


# --- 06: the profiled training step ----------------------------------------------------------------------

@pytest.mark.parametrize("name", ["sequential", "fused_qkv", "llama"])
def test_06_train_step_updates_as_a_plain_step_records_its_ranges_and_never_copies_unpinned_non_blocking(
        name, monkeypatch):
    from torch.profiler import ProfilerActivity, profile

    train_step = run_recipe("06")["train_step"]
    model, inputs, labels = _case(name)
    start = {key: value.clone() for key, value in model.state_dict().items()}
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    _loss(model, inputs, labels).backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    expected = [p.detach().clone() for p in model.parameters()]
    model.load_state_dict(start)

    copies = []
    real_to = torch.Tensor.to

    def recording_to(self, *args, **kwargs):
        copies.append((self.is_pinned(), kwargs.get("non_blocking", False)))
        return real_to(self, *args, **kwargs)

    monkeypatch.setattr(torch.Tensor, "to", recording_to)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        train_step(iter([(inputs, labels)]), model, optimizer)
    monkeypatch.setattr(torch.Tensor, "to", real_to)
    assert all(torch.allclose(p, e, rtol=1e-5, atol=1e-7) for p, e in zip(model.parameters(), expected)), \
        "the profiled step must update as a plain step does"
    assert set(utils.range_times_ms(prof, ["data", "forward", "backward", "optimizer"])) == \
        {"data", "forward", "backward", "optimizer"}
    assert len(copies) >= 2 and not any(non_blocking and not pinned for pinned, non_blocking in copies), \
        "non_blocking=True from pageable memory: the host waits anyway"


# --- 01's one bf16 section, sized for a CPU without native bf16 (issue 45) -----------------------------------------

def test_01_section_6_cuts_its_bf16_step_where_the_probe_finds_bf16_slow_and_still_measures_exactly(monkeypatch, tmp_path):
    """Notebook 01 in check mode, up to the end of section 6, with a faked slow-bf16 probe (40x fp32, as on an AVX2
    CPU): the one bf16 training step runs on fewer rows, says so, and every byte of section 6 still matches."""
    import contextlib
    import io
    import json

    from recipe_models import notebook_path

    monkeypatch.setenv("PYTORCH_INTRO_CHECK_MODE", "1")
    monkeypatch.setenv("PYTORCH_INTRO_BUILD_DIR", str(tmp_path))
    monkeypatch.setenv("PYTORCH_INTRO_FORMAT_SLOWDOWN", "bfloat16=40,float16=40")
    cells = [c for c in json.loads(notebook_path("01").read_text())["cells"] if c["cell_type"] == "code"]
    end = next(i for i, c in enumerate(cells) if "assert 16 <= mixed_per_param < 16.1" in "".join(c["source"]))
    namespace, printed = {}, io.StringIO()
    with contextlib.redirect_stdout(printed):
        for cell in cells[:end + 1]:
            exec(compile("".join(cell["source"]), "<01>", "exec"), namespace)
    assert namespace["low_speed"].slow and namespace["low_speed"].faked
    assert namespace["MIXED_ROWS"] == 8 < namespace["BATCH_SIZES"][0], "the step is cut, never below 8 rows"
    assert f"this section's step: 8 rows (cut from {namespace['BATCH_SIZES'][0]})" in printed.getvalue()
    assert "faked by PYTORCH_INTRO_FORMAT_SLOWDOWN" in printed.getvalue()


def test_06_train_step_feeds_a_conv_net_its_images_as_they_come():
    """A reader's conv net takes (B, 3, H, W) images: the profiled step hands them over unflattened (it flattened every
    input of more than two dimensions for the notebook's MLP, and a conv net then crashed in conv2d)."""
    from recipe_models import batchnorm_convnet

    train_step = run_recipe("06")["train_step"]
    model = batchnorm_convnet()
    generator = torch.Generator().manual_seed(0)
    images, labels = torch.randn(4, 3, 8, 8, generator=generator), torch.randint(0, 5, (4,), generator=generator)
    start = {key: value.clone() for key, value in model.state_dict().items()}
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    nn.functional.cross_entropy(model(images), labels).backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    expected = {key: value.clone() for key, value in model.state_dict().items()}
    model.load_state_dict(start)
    train_step(iter([(images, labels)]), model, optimizer)
    for key, value in model.state_dict().items():
        torch.testing.assert_close(value, expected[key], msg=key)
