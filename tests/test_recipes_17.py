"""Notebook 17's recipe (``checkpoint_each`` with its BatchNorm workaround, ``build_recipe``, ``train_step``,
``make_scaler`` and the loss and batch helpers), taken from the notebook's cells tagged ``recipe`` and run on models it
was not written for, each asserting the notebook's claims:

* the gradient handed to the optimizer is the plain whole-batch gradient (to summation order in fp32, to 16-bit
  rounding under autocast) however the batch divides and wherever the padding is, on every family of
  ``tests/recipe_models.py`` the step applies to: transformers Llama (fp32, bf16 autocast over fp32 weights, a bf16
  base), Qwen2 (biases, tied head), GPT-2 (Conv1D; its dropout off, so that the reference draws no masks), a bf16
  Mistral with a sliding window, an ``nn.TransformerEncoder`` classifier with a padding mask (dict batches), a
  BatchNorm conv net (in one piece: BatchNorm normalises each piece with its own statistics, notebook 02), an
  ``nn.Sequential``, a fused-qkv toy, and right-padded dict batches from a ``DataLoader``;
* checkpointing a block that holds BatchNorm leaves the running statistics as the plain step does (issue 38: the
  recomputation used to count every batch twice); checkpointing keeps the state-dict keys; one sync per step; a
  GradScaler forced on unscales, and skips an overflow;
* each recipe cell names what it expects the reader's script to define;
* MFU (issue 42), run on a CPU through the fake CUDA (``tests/fake_cuda.py``): against the datasheet peak of the card
  torch names and against a matmul measured on it, both printed; an unknown GPU or a CPU says "unknown".
"""
from __future__ import annotations

import contextlib
import io
import json
import math

import pytest
import torch
import torch.nn.functional as F

from tests.recipe_models import (CAUSAL_LM_FAMILIES, EncoderClassifier, FusedQKVModel, batchnorm_convnet,
                                 notebook_path, padded_dict_batches, padded_tokens, recipe_cells, run_recipe,
                                 sequential_mlp)

VOCAB, LENGTH, ROWS, PIECES = 64, 12, 7, 3          # 7 rows in 3 pieces: 3, 3 and 1
SETTINGS = {"AMP_DTYPE": torch.bfloat16, "DEVICE": torch.device("cpu"), "LEARNING_RATE": 1e-3,
            "COMPILE_BACKEND": "aot_eager"}


@pytest.fixture(scope="module")
def recipe() -> dict:
    return run_recipe("17", namespace=dict(SETTINGS))


def test_every_recipe_cell_names_what_it_expects() -> None:
    cells = recipe_cells("17")
    assert all(cell.startswith("# Expects: ") for cell in cells), [cell.splitlines()[0] for cell in cells]
    named = " ".join(cell.splitlines()[0] + cell.splitlines()[1] for cell in cells)
    assert all(name in named for name in SETTINGS), "the four names the cells need from the reader's script"


def _flat_grad(model) -> torch.Tensor:
    return torch.cat([p.grad.flatten().float() for p in model.parameters() if p.grad is not None])


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


def _causal_lm(recipe, name: str, dtype: torch.dtype, dict_batches: bool = False):
    """A transformers causal LM, a padded batch (a dict from a DataLoader's collator, or built), its own loss's
    gradient, and the recipe's shifted loss and count for it."""
    options = {"dropout": 0.0} if name == "gpt2" else {}
    build = lambda: _configured(CAUSAL_LM_FAMILIES[name](dtype=dtype, vocab_size=VOCAB, **options))  # noqa: E731
    if dict_batches:
        batch = padded_dict_batches(ROWS, size=ROWS, vocab=VOCAB, max_length=LENGTH, seed=6)[0]
        labels = batch.pop("labels")
        inputs = batch
    else:
        input_ids, attention_mask, labels = padded_tokens(ROWS, LENGTH, VOCAB, seed=2)
        inputs = {"input_ids": input_ids, "attention_mask": attention_mask}
    plain = build()
    plain(**inputs, labels=labels).loss.backward()
    step_options = {"loss_sum": lambda outputs, labels: recipe["token_loss_sum"](outputs.logits[:, :-1], labels[:, 1:]),
                    "count": lambda labels: recipe["count_targets"](labels[:, 1:])}
    blocks = (lambda m: m.transformer.h) if name == "gpt2" else (lambda m: m.model.layers)
    return build, blocks, inputs, labels, _flat_grad(plain), step_options


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


def _encoder_case(recipe):
    batch = padded_dict_batches(ROWS, size=ROWS, vocab=VOCAB, max_length=LENGTH, seed=5)[0]
    inputs = {"input_ids": batch["input_ids"], "attention_mask": batch["attention_mask"]}
    classes = torch.randint(0, 3, (ROWS,), generator=torch.Generator().manual_seed(7))
    plain = EncoderClassifier(vocab=VOCAB)
    F.cross_entropy(plain(**inputs), classes).backward()
    options = {"loss_sum": lambda logits, targets: F.cross_entropy(logits, targets, reduction="sum"),
               "count": lambda targets: torch.tensor(len(targets))}
    return (lambda: EncoderClassifier(vocab=VOCAB)), (lambda m: m.encoder.layers), inputs, classes, \
        _flat_grad(plain), options


CASES = {   # name -> (how to make the case, the step's dtype, micro-batches)
    "llama, fp32 weights": (lambda r: _causal_lm(r, "llama", torch.float32), torch.float32, PIECES),
    "llama, bf16 autocast over fp32 weights": (lambda r: _causal_lm(r, "llama", torch.float32), torch.bfloat16, PIECES),
    "llama, bf16 base": (lambda r: _causal_lm(r, "llama", torch.bfloat16), torch.bfloat16, PIECES),
    "qwen2 (biases, tied head)": (lambda r: _causal_lm(r, "qwen2", torch.float32), torch.float32, PIECES),
    "qwen2, dict batches from a DataLoader": (lambda r: _causal_lm(r, "qwen2", torch.float32, True), torch.float32,
                                              PIECES),
    "gpt2 (Conv1D), bf16 autocast": (lambda r: _causal_lm(r, "gpt2", torch.float32), torch.bfloat16, PIECES),
    "mistral bf16, sliding window": (lambda r: _causal_lm(r, "mistral-bf16-sliding", torch.bfloat16), torch.bfloat16,
                                     PIECES),
    "encoder classifier, padding mask": (_encoder_case, torch.float32, PIECES),
    "sequential": (_sequential_case, torch.float32, PIECES),
    "fused qkv, bf16 autocast": (_fused_qkv_case, torch.bfloat16, PIECES),
}


@pytest.mark.parametrize("case", list(CASES))
def test_the_step_hands_the_optimizer_the_plain_gradient(recipe, case: str) -> None:
    make, amp, pieces = CASES[case]
    build, blocks, inputs, targets, reference, options = make(recipe)
    model, _ = recipe["build_recipe"](build, checkpointed=True, blocks=blocks)
    gradient = _gradient_seen_by_optimizer(model, lambda probe: recipe["train_step"](
        model, probe, recipe["make_scaler"](amp), inputs, targets, pieces, amp, **options))
    error = _relative(gradient, reference)
    # fp32: the same sums in another order, each entry a sum over at most ROWS * LENGTH terms; 16-bit: the format's
    # rounding (the notebook's GRADIENT_TOLERANCE); a bf16 base rounds the plain reference too, hence twice that
    tolerance = {torch.float32: ROWS * LENGTH * torch.finfo(torch.float32).eps,
                 torch.bfloat16: 2 * torch.finfo(torch.bfloat16).eps}[amp] * (2 if "bf16 base" in case
                                                                                or "mistral" in case else 1)
    assert error < tolerance, f"{case}: the recipe's gradient is {error:.2e} from the plain step's"
    assert all(p.grad is None for p in model.parameters()), "the step frees the gradients"


def _batchnorm_step(recipe, checkpointed: bool, checkpoint=None):
    """One fp32 recipe step (one piece) of the BatchNorm conv net; its state after the step and the gradient seen."""
    images = torch.randn(6, 3, 8, 8, generator=torch.Generator().manual_seed(8))
    classes = torch.randint(0, 5, (6,), generator=torch.Generator().manual_seed(9))
    model, _ = recipe["build_recipe"](batchnorm_convnet, checkpointed=checkpointed, blocks=lambda m: [m[0], m[1]])
    options = {"loss_sum": lambda logits, targets: F.cross_entropy(logits, targets, reduction="sum"),
               "count": lambda targets: torch.tensor(len(targets))}
    gradient = _gradient_seen_by_optimizer(model, lambda probe: recipe["train_step"](
        model, probe, recipe["make_scaler"](torch.float32), images, classes, 1, torch.float32, **options))
    return model.state_dict(), gradient


def test_checkpointing_a_batchnorm_block_counts_the_batch_once(recipe) -> None:
    """Issue 38: the recomputation is a second forward; the recipe restores the running statistics after it."""
    plain, plain_gradient = _batchnorm_step(recipe, checkpointed=False)
    checkpointed, gradient = _batchnorm_step(recipe, checkpointed=True)
    assert _relative(gradient, plain_gradient) < 1e-5, "checkpointing changed the gradient"
    for name, value in plain.items():
        assert torch.equal(checkpointed[name], value), f"{name}: {checkpointed[name]} after the checkpointed step"


def test_checkpoint_alone_would_count_the_batch_twice(recipe) -> None:
    """The check above can fail: the same blocks under a bare non-reentrant checkpoint move the statistics twice."""
    plain, _ = _batchnorm_step(recipe, checkpointed=False)
    workaround = recipe["recompute_keeping_running_stats"]      # checkpoint_each looks it up when it runs
    recipe["recompute_keeping_running_stats"] = lambda block: (contextlib.nullcontext(), contextlib.nullcontext())
    try:
        checkpointed, _ = _batchnorm_step(recipe, checkpointed=True)
    finally:
        recipe["recompute_keeping_running_stats"] = workaround
    counts = [int(v) for name, v in checkpointed.items() if name.endswith("num_batches_tracked")]
    assert counts == [2, 2], counts
    assert not torch.equal(checkpointed["0.1.running_mean"], plain["0.1.running_mean"])


def test_checkpointing_keeps_the_state_dict_keys(recipe) -> None:
    for build, blocks in [(lambda: _configured(CAUSAL_LM_FAMILIES["llama"](vocab_size=VOCAB)), lambda m: m.model.layers),
                          (batchnorm_convnet, lambda m: [m[0], m[1]])]:
        plain = build()
        model, _ = recipe["build_recipe"](build, checkpointed=True, blocks=blocks)
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


# --- MFU against two peaks, through the fake CUDA (issue 42) -------------------------------------------------

def _code_cells() -> list[str]:
    notebook = json.loads(notebook_path("17").read_text())
    return ["".join(c["source"]) for c in notebook["cells"] if c["cell_type"] == "code"]


def _mfu_cells(namespace: dict, matmul_size: int) -> str:
    """The parameters and set-up cells, then the cells that define and compute the two peaks; what they printed."""
    cells = _code_cells()
    table = next(i for i, source in enumerate(cells) if source.startswith("DATASHEET_TFLOPS = ["))
    peaks = next(i for i, source in enumerate(cells) if "DATASHEET_PEAK, DATASHEET_SOURCE = datasheet_peak_flops" in source)
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        for source in cells[:2]:
            exec(compile(source, "<17>", "exec"), namespace)
        namespace["MFU_MATMUL_SIZE"] = matmul_size           # a CPU multiplies it for real: keep it small
        for source in cells[table:peaks + 1]:
            exec(compile(source, "<17>", "exec"), namespace)
    return printed.getvalue()


@pytest.fixture
def check_mode_build(monkeypatch, tmp_path):
    monkeypatch.setenv("PYTORCH_INTRO_CHECK_MODE", "1")
    monkeypatch.setenv("PYTORCH_INTRO_BUILD_DIR", str(tmp_path))
    monkeypatch.setenv("PYTORCH_INTRO_FORMAT_SLOWDOWN", "bfloat16=1,float16=1")   # the probe answers at once
    return tmp_path


def test_mfu_against_the_datasheet_and_the_measured_matmul(check_mode_build, monkeypatch) -> None:
    from fake_cuda import FakeCuda, GpuModel
    fake = FakeCuda(capability=(9, 0), name="NVIDIA H100 80GB HBM3").install(monkeypatch)
    namespace: dict = {}
    with fake.run_as_gpu(GpuModel(launch_us=0.0, bf16_tflops=800.0)):
        printed = _mfu_cells(namespace, 64)
    assert namespace["DEVICE"].type == "cuda" and namespace["AMP_DTYPE"] == torch.bfloat16
    assert namespace["DATASHEET_PEAK"] == 989e12 and "NVIDIA H100 datasheet (SXM5)" in namespace["DATASHEET_SOURCE"]
    assert namespace["PEAK_FLOPS"] == pytest.approx(800e12, rel=1e-6), "the modelled matmul rate, read back"
    mfu = namespace["model_flops_utilisation"](400e12 * 0.01, 0.01)         # a step at 400 TFLOP/s
    assert mfu["datasheet"] == pytest.approx(400 / 989) and mfu["measured matmul"] == pytest.approx(0.5)
    assert "datasheet peak: NVIDIA H100 80GB HBM3 0: 989 TFLOP/s dense 16-bit" in printed
    assert "81% of the datasheet's: MFU against it reads 1.24x higher" in printed
    assert any(name == "Event" for name, _, _ in fake.calls), "the matmul is timed with CUDA events"


@pytest.mark.parametrize("name,expected", [("NVIDIA H100 PCIe", 756e12), ("NVIDIA A100-SXM4-80GB", 312e12),
                                           ("NVIDIA L4", 121e12), ("NVIDIA L40S", 362e12),
                                           ("Tesla V100-PCIE-16GB", 112e12), ("NVIDIA H200", 989e12)])
def test_the_datasheet_table_takes_the_most_specific_name(check_mode_build, monkeypatch, name, expected) -> None:
    from fake_cuda import FakeCuda
    FakeCuda(capability=(8, 0), name=name).install(monkeypatch)
    namespace: dict = {}
    cells = _code_cells()
    with contextlib.redirect_stdout(io.StringIO()):
        for source in cells[:2] + [next(s for s in cells if s.startswith("DATASHEET_TFLOPS = ["))]:
            exec(compile(source, "<17>", "exec"), namespace)
    assert namespace["datasheet_peak_flops"](namespace["DEVICE"])[0] == expected


def test_an_unknown_gpu_and_a_cpu_say_unknown(check_mode_build, monkeypatch) -> None:
    from fake_cuda import FakeCuda, GpuModel
    fake = FakeCuda(capability=(8, 9), name="Some Future GPU").install(monkeypatch)
    namespace: dict = {}
    with fake.run_as_gpu(GpuModel(launch_us=0.0)):
        printed = _mfu_cells(namespace, 64)
    assert namespace["DATASHEET_PEAK"] is None and "not in the table of datasheet peaks" in printed
    mfu = namespace["model_flops_utilisation"](1e12, 1.0)
    assert math.isnan(mfu["datasheet"]) and mfu["measured matmul"] > 0
    monkeypatch.undo()
    monkeypatch.setenv("PYTORCH_INTRO_CHECK_MODE", "1")
    monkeypatch.setenv("PYTORCH_INTRO_BUILD_DIR", str(check_mode_build))
    monkeypatch.setenv("PYTORCH_INTRO_FORMAT_SLOWDOWN", "bfloat16=1,float16=1")
    namespace = {}
    printed = _mfu_cells(namespace, 64)
    assert namespace["DEVICE"].type == "cpu" and namespace["PEAK_FLOPS"] is None
    assert "no datasheet peak on a cpu" in printed and "MFU needs a GPU" in printed


# --- sized to the machine: a CPU without native bf16 (issue 45) -------------------------------------------------

@pytest.mark.parametrize("slowdown", [30, 1])
def test_a_slow_16_bit_format_cuts_the_sections_that_train_in_it(monkeypatch, tmp_path, slowdown) -> None:
    """Full mode's parameters and set-up cells with a faked probe: emulated bf16 (30x fp32's time) cuts the recipe's
    and the ladder's steps, the repeats, the budgets and the probes' batch, and says so; native bf16 cuts nothing."""
    monkeypatch.setenv("PYTORCH_INTRO_CHECK_MODE", "0")
    monkeypatch.setenv("PYTORCH_INTRO_BUILD_DIR", str(tmp_path))
    monkeypatch.setenv("PYTORCH_INTRO_FORMAT_SLOWDOWN", f"bfloat16={slowdown},float16={slowdown}")
    namespace: dict = {}
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        for source in _code_cells()[:2]:
            exec(compile(source, "<17>", "exec"), namespace)
    sizes = {name: namespace[name] for name in ("RECIPE_STEPS", "LADDER_STEPS", "TIMING_REPEATS", "RECIPE_BATCH",
                                                "BUDGET_MIB", "LLAMA_BUDGET_MIB", "SMALL_BATCH")}
    if slowdown == 30:
        assert sizes == {"RECIPE_STEPS": 8, "LADDER_STEPS": 3, "TIMING_REPEATS": 5, "RECIPE_BATCH": 16,
                         "BUDGET_MIB": 16, "LLAMA_BUDGET_MIB": 16, "SMALL_BATCH": 16}, sizes
        assert "bf16 matmuls take 30.0x fp32's time" in printed.getvalue() and "cut here: RECIPE_STEPS 30 -> 8" in \
            printed.getvalue()
    else:
        assert sizes == {"RECIPE_STEPS": 30, "LADDER_STEPS": 6, "TIMING_REPEATS": 9, "RECIPE_BATCH": 32,
                         "BUDGET_MIB": 48, "LLAMA_BUDGET_MIB": 48, "SMALL_BATCH": 32}, sizes
        assert "nothing cut" in printed.getvalue()
    assert namespace["BUDGET_BYTES"] == sizes["BUDGET_MIB"] * 2**20


# --- held-out models (issue 38's paste test): families the tests above do not name ---------------------------------

@pytest.mark.parametrize("family", ["opt", "gemma2", "phi3", "gpt-neox"])
def test_held_out_decoders_refuse_the_cache_by_name_then_step_like_the_plain_model(recipe, family) -> None:
    """A transformers decoder as its config builds it (use_cache=True) used to fail in backward with 'The size of
    tensor a (24) must match the size of tensor b (12)', the cache written again by the recomputation; it is refused
    by name. With use_cache=False the step's gradient is the plain model's, on a left-padded batch whose row 2 has
    only -100 labels, 5 rows in 3 pieces (2, 2 and 1)."""
    from tests.recipe_models_heldout import HELD_OUT_CAUSAL_LMS, left_padded
    builder, blocks = HELD_OUT_CAUSAL_LMS[family]
    with pytest.raises(ValueError, match="use_cache = False"):
        recipe["build_recipe"](builder, checkpointed=True, blocks=blocks)
    input_ids, attention_mask, labels = left_padded()
    inputs = {"input_ids": input_ids, "attention_mask": attention_mask}
    plain = builder()
    plain(**inputs, labels=labels).loss.backward()
    model, _ = recipe["build_recipe"](lambda: _configured(builder()), checkpointed=True, blocks=blocks)
    options = {"loss_sum": lambda outputs, labels: recipe["token_loss_sum"](outputs.logits[:, :-1], labels[:, 1:]),
               "count": lambda labels: recipe["count_targets"](labels[:, 1:])}
    gradient = _gradient_seen_by_optimizer(model, lambda probe: recipe["train_step"](
        model, probe, recipe["make_scaler"](torch.float32), inputs, labels, PIECES, torch.float32, **options))
    assert _relative(gradient, _flat_grad(plain)) < labels.numel() * torch.finfo(torch.float32).eps
