"""The training-memory calculator: bad input, published shapes, and prediction against the exact CPU tracker."""

import math
import time
from dataclasses import replace
from pathlib import Path

import pytest
import torch

import utils
from utils import calculator as C
from utils import parallel

TINY = C.ModelConfig(num_layers=2, d_model=32, num_heads=4, vocab_size=64, max_seq_len=16)
TINY_SETUP = C.TrainingSetup(micro_batch=2, seq_len=16, precision="fp32", optimizer_impl="for-loop", device="cpu")


# --- bad input: a clear error naming what was expected, before any work --------------------------------------

def test_unknown_preset_names_the_presets():
    with pytest.raises(ValueError, match=r"unknown preset '3B': expected one of 1B \(Llama-3.2-1B\), 7B"):
        C.preset("3B")
    with pytest.raises(SystemExit):
        C.main(["--preset", "3B"])


@pytest.mark.parametrize("field", ["num_layers", "d_model", "num_heads", "vocab_size", "max_seq_len"])
@pytest.mark.parametrize("bad", [0, -3, 2.5, True])
def test_model_sizes_must_be_positive_ints(field, bad):
    kwargs = dict(num_layers=2, d_model=32, num_heads=4, vocab_size=64, max_seq_len=16)
    kwargs[field] = bad
    with pytest.raises(ValueError, match=f"{field} must be a positive int"):
        C.ModelConfig(**kwargs)


def test_heads_must_divide_the_width():
    with pytest.raises(ValueError, match=r"num_heads \(5\) must divide d_model \(32\): expected a head count such as"):
        C.ModelConfig(num_layers=2, d_model=32, num_heads=5, vocab_size=64)
    with pytest.raises(ValueError, match=r"num_kv_heads \(3\) must divide num_heads \(4\)"):
        C.ModelConfig(num_layers=2, d_model=32, num_heads=4, num_kv_heads=3, vocab_size=64, arch="llama")
    with pytest.raises(ValueError, match="one key/value head per query head"):
        C.ModelConfig(num_layers=2, d_model=32, num_heads=4, num_kv_heads=2, vocab_size=64)
    with pytest.raises(ValueError, match="arch must be one of"):
        C.ModelConfig(num_layers=2, d_model=32, num_heads=4, vocab_size=64, arch="mamba")
    with pytest.raises(ValueError, match="tied_embeddings is modelled for arch 'llama' only"):
        C.ModelConfig(num_layers=2, d_model=32, num_heads=4, vocab_size=64, tied_embeddings=True)


@pytest.mark.parametrize("changes, message", [
    ({"micro_batch": 0}, "micro_batch must be a positive int"),
    ({"seq_len": -1}, "seq_len must be a positive int"),
    ({"accumulation_steps": 0}, "accumulation_steps must be a positive int"),
    ({"ranks": 0}, "ranks must be a positive int"),
    ({"precision": "fp16"}, "precision must be one of"),
    ({"optimizer": "lion"}, "optimizer must be one of"),
    ({"checkpointing": "half"}, "checkpointing must be one of"),
    ({"lora_rank": -4}, r"lora_rank must be an int >= 0 \(0 turns it off\)"),
    ({"chunked_loss": True}, "chunked_loss must be an int >= 0"),
    ({"strategy": "zero2", "ranks": 1}, "strategy 'zero2' needs at least 2 ranks"),
    ({"strategy": "fsdp"}, "strategy 'fsdp' needs at least 2 ranks"),
    ({"ranks": 8}, "strategy 'single' trains on one device: expected ranks=1"),
    ({"optimizer": "adafactor", "optimizer_impl": "fused"}, "torch.optim has no fused 'adafactor'"),
    ({"optimizer": "adamw8bit", "optimizer_impl": "foreach"}, "one tensor at a time: expected optimizer_impl 'for-loop'"),
])
def test_bad_training_setups_are_named(changes, message):
    with pytest.raises(ValueError, match=message):
        replace(TINY_SETUP, **changes)


def test_bad_arguments_to_the_functions():
    with pytest.raises(ValueError, match=r"seq_len 32 exceeds the model's position table \(max_seq_len 16\)"):
        C.predict(TINY, replace(TINY_SETUP, seq_len=32))
    with pytest.raises(TypeError, match="model must be a ModelConfig"):
        C.predict("7B", TINY_SETUP)
    with pytest.raises(TypeError, match="setup must be a TrainingSetup"):
        C.predict(TINY, {"micro_batch": 1})
    with pytest.raises(ValueError, match="device_bytes must be a positive int"):
        C.largest_micro_batch(TINY, TINY_SETUP, 0)
    with pytest.raises(TypeError, match="expected a MemoryBreakdown"):
        C.format_table(42)
    with pytest.raises(SystemExit):   # a preset fixes the shape
        C.main(["--preset", "7B", "--layers", "4"])
    with pytest.raises(SystemExit):   # no preset and no shape
        C.main(["--micro-batch", "2"])
    with pytest.raises(SystemExit):   # the dataclasses' errors reach the command line as usage errors
        C.main(["--preset", "1B", "--strategy", "fsdp"])


# --- shapes: published parameter counts, and the reference models ------------------------------------------------

@pytest.mark.parametrize("name, count", [("1B", 1_235_814_400), ("7B", 6_738_415_616), ("13B", 13_015_864_320),
                                         ("70B", 68_976_648_192)])
def test_presets_have_the_published_parameter_counts(name, count):
    assert C.count_parameters(C.preset(name)) == count


@pytest.mark.parametrize("model", [TINY, C.GRID_LLAMA, replace(C.GRID_LLAMA, num_kv_heads=1, tied_embeddings=True)])
@pytest.mark.parametrize("lora", [0, 4])
def test_parameter_shapes_follow_the_reference_models(model, lora):
    setup = replace(TINY_SETUP, lora_rank=lora)
    net, _ = C.build_reference(model, setup)
    expected = [(tuple(p.shape), p.requires_grad) for p in net.parameters()]
    assert [(shape, trainable) for _, shape, trainable in C.parameter_shapes(model, setup)] == expected


# --- the prediction against the exact CPU tracker -----------------------------------------------------------------

def test_check_grid_covers_every_option():
    grid = C.validation_grid(check=True)
    setups = [setup for _, _, setup in grid]
    for field, values in [("precision", C.PRECISIONS), ("optimizer", C.OPTIMIZERS), ("optimizer_impl", C.OPTIMIZER_IMPLS),
                          ("checkpointing", C.CHECKPOINTING)]:
        assert {getattr(s, field) for s in setups} == set(values), field
    assert {s.lora_targets for s in setups if s.lora_rank} == set(C.LORA_TARGETS)
    assert any(s.chunked_loss for s in setups) and any(s.accumulation_steps > 1 for s in setups)
    assert {model.arch for _, model, _ in grid} == set(C.ARCHS)
    assert len(C.validation_grid()) >= 30


def test_prediction_equals_the_tracker_to_the_byte():
    """Check mode's subset of the grid: every term, the peak and every phase boundary, 0 bytes apart (the bound)."""
    started = time.perf_counter()
    rows = C.validate(check=True)
    seconds = time.perf_counter() - started
    for row in rows:
        assert row.differences() == dict.fromkeys(C.MEASURED_TERMS, 0), (row.label, row.differences())
        assert row.boundaries_equal, row.label
        assert row.predicted.boundaries.keys() >= {k for k in row.measured.boundaries if k[:2] in ("m0", "m1")}
    assert C.worst_errors(rows) == dict.fromkeys(C.MEASURED_TERMS, 0.0)
    print(f"check grid: {len(rows)} configurations measured in {seconds:.1f} s")
    assert "all equal" in C.format_validation(rows)


def test_breakdown_terms_sum_to_the_peak_and_name_its_phase():
    for precision in C.PRECISIONS:
        breakdown = C.predict(TINY, replace(TINY_SETUP, precision=precision))
        assert breakdown.total == sum(breakdown.terms().values()) == C.predict_step_bytes(TINY, replace(
            TINY_SETUP, precision=precision)).peak
        for kind, value in breakdown.terms().items():
            assert breakdown.largest[kind] >= value, kind
        assert breakdown.phase.split(",")[0] in ("forward", "backward", "optimizer step")


def test_terms_follow_the_courses_formulas():
    model, setup = C.preset("7B"), C.TrainingSetup(micro_batch=1, seq_len=2048)
    psi = C.count_parameters(model)
    inv_freq = 4 * model.head_dim // 2                                # the rotary embedding's buffer
    base = C.predict(model, setup)
    assert base.largest["parameters"] == 4 * psi + inv_freq and base.largest["gradients"] == 4 * psi
    assert base.largest["optimizer_state"] == 8 * psi                 # on CUDA the step counters stay on the host
    embedding = model.vocab_size * model.d_model                       # a lookup: autocast does not cast it
    norms = (2 * model.num_layers + 1) * model.d_model                 # RMSNorm's weight multiplies in fp32
    assert base.largest["weight_copies"] == 2 * (psi - embedding - norms)   # a bf16 copy of every matmul weight
    assert base.largest["temporaries"] >= 4 * psi                     # foreach AdamW: sqrt of every exp_avg_sq
    pure = C.predict(model, replace(setup, precision="bf16"))
    assert pure.largest["parameters"] - inv_freq // 2 == pure.largest["gradients"] == 2 * psi
    assert pure.largest["optimizer_state"] == 4 * psi
    fused = C.predict(model, replace(setup, optimizer_impl="fused"))
    assert fused.total < base.total and fused.largest["optimizer_state"] == 8 * psi + 4 * len(C.parameter_shapes(model))
    every = C.predict(model, replace(setup, checkpointing="every_block"))
    selective = C.predict(model, replace(setup, checkpointing="selective"))
    assert every.largest["activations"] < selective.largest["activations"] < base.largest["activations"]
    chunked = C.predict(model, replace(setup, chunked_loss=256))
    assert chunked.largest["loss"] < base.largest["loss"] / 4
    lora = C.predict(model, replace(setup, lora_rank=16))
    assert lora.trainable_parameters < psi // 100 and lora.largest["gradients"] == 4 * lora.trainable_parameters
    assert C.predict(model, replace(setup, accumulation_steps=8)).total >= base.total


# --- data parallelism: per-rank model state, ZeRO's formulas ------------------------------------------------------

@pytest.mark.parametrize("strategy, stage", [("ddp", 0), ("zero1", 1), ("zero2", 2), ("fsdp", 3)])
@pytest.mark.parametrize("optimizer", ["sgd", "sgd_momentum", "adam", "adamw"])
@pytest.mark.parametrize("precision", ["fp32", "bf16-autocast"])
def test_model_state_per_rank_equals_zero_formulas(strategy, stage, optimizer, precision):
    setup = replace(TINY_SETUP, strategy=strategy, ranks=4, optimizer=optimizer, precision=precision)
    state = C.model_state_per_rank(TINY, setup)
    zero = parallel.predict_zero_bytes_per_rank(C.count_parameters(TINY), 4, stage, optimizer=optimizer,
                                                precision="fp32", num_tensors=len(C.parameter_shapes(TINY)))
    assert (state["params"], state["grads"], state["optimizer"]) == (zero.params_bytes, zero.grads_bytes,
                                                                      zero.optimizer_bytes)
    breakdown = C.predict(TINY, setup)
    assert breakdown.largest["comm_buffers"] >= state["buckets"] > 0 or strategy in ("zero2", "fsdp")


def test_one_in_process_ddp_rank_allocates_the_predicted_buckets():
    """DDP's Reducer allocates its gradient buckets when it wraps the model: one copy of the trainable gradients."""
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    if dist.is_initialized():
        pytest.skip("a process group exists in this process already")
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        for changes in ({}, {"precision": "bf16"}, {"lora_rank": 4}):
            setup = replace(TINY_SETUP, strategy="ddp", ranks=2, **changes)
            net, _ = C.build_reference(TINY, setup)
            with utils.measure_memory("cpu", include=net) as mem:
                wrapped = DistributedDataParallel(net)
            assert mem.end_bytes == C.model_state_per_rank(TINY, setup)["buckets"], changes
            del wrapped
    finally:
        dist.destroy_process_group()


# --- largest micro-batch, the table, the command line -------------------------------------------------------------

def test_largest_micro_batch_is_the_boundary():
    device_bytes = 800_000
    best = C.largest_micro_batch(TINY, TINY_SETUP, device_bytes, limit=16)
    assert 1 <= best < 16
    assert C.predict(TINY, replace(TINY_SETUP, micro_batch=best)).total <= device_bytes
    assert C.predict(TINY, replace(TINY_SETUP, micro_batch=best + 1)).total > device_bytes
    assert C.largest_micro_batch(TINY, TINY_SETUP, 10_000) == 0          # the model state alone does not fit


def test_format_table_lists_every_term_and_the_verdict():
    breakdown = C.predict(C.preset("1B"), C.TrainingSetup(micro_batch=2, seq_len=2048, checkpointing="every_block"))
    table = C.format_table(breakdown, device_bytes=80 * 10**9)
    assert "Llama-3.2-1B" in table and f"peak ({breakdown.phase})" in table
    for kind in ("parameters", "gradients", "optimizer state", "activations", "loss and logits"):
        assert kind in table
    assert ("fits in" in table) == (breakdown.total <= 80 * 10**9)


def test_command_line_prints_the_preset_table(capsys):
    assert C.main(["--preset", "7B", "--device-gb", "80"]) == 0
    out = capsys.readouterr().out
    assert "Llama-2-7B: 6.738 B parameters" in out and "peak (" in out and "micro-batch" in out
    with pytest.raises(SystemExit) as help_exit:
        C.main(["--help"])
    assert help_exit.value.code == 0
    assert "Llama-2-70B" in capsys.readouterr().out


def test_custom_shape_from_the_command_line(capsys):
    assert C.main(["--layers", "2", "--d-model", "64", "--heads", "4", "--vocab", "100", "--seq-len", "32",
                   "--precision", "fp32", "--device-gb", "0"]) == 0
    out = capsys.readouterr().out
    expected = C.predict(C.ModelConfig(2, 64, 4, 100, max_seq_len=2048, arch="llama"),
                         C.TrainingSetup(micro_batch=1, seq_len=32, precision="fp32"))
    assert f"{expected.total / 2**30:,.2f}" in out


def test_a_question_about_a_config_file_imports_neither_torch_nor_matplotlib():
    """Issue 43: the README's 70B QLoRA command, its largest-micro-batch search included, needs only Python."""
    import subprocess
    import sys

    code = ("import sys; from utils.calculator import main; "
            "main(['--hf-config', 'llama-2-70b', '--precision', 'bf16', '--lora-rank', '16', '--base-quant', "
            "'nf4-double', '--checkpointing', 'every_block', '--seq-len', '2048']); "
            "print(sorted(m for m in ('torch', 'matplotlib', 'numpy', 'transformers') if m in sys.modules))")
    done = subprocess.run([sys.executable, "-c", code], cwd=Path(__file__).resolve().parents[1], capture_output=True,
                          text=True)
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines()[-1] == "[]"
    assert "largest micro-batch of 2048 tokens that fits:" in done.stdout
    breakdown = C.predict(C.preset("70B"), C.TrainingSetup(seq_len=4096, strategy="fsdp", ranks=64,
                                                          checkpointing="every_block"))
    assert breakdown.parameters == math.ceil(C.count_parameters(C.preset("70B")) * 4 / 64) or breakdown.parameters > 0
    assert not torch.is_tensor(breakdown.total)


def test_the_calculator_is_a_package_of_short_modules_one_per_family():
    """Issues 33 and 43: one file per part of the design (engine, ops, families, optimizers, command line,
    validation), each short enough to read in one sitting, named for what it holds."""
    package = Path(C.__file__).parent
    assert package.name == "calculator" and not (package.parent / "calculator.py").exists()
    lengths = {str(path.relative_to(package)): len(path.read_text().splitlines()) for path in package.rglob("*.py")}
    assert {"replay.py", "ops.py", "step.py", "layer_reuse.py", "from_transformers.py", "registry.py", "optimizers.py",
            "data_parallel.py", "fewer_bits.py", "model_parallel.py", "parallel_tensors.py", "parallel_layout.py",
            "cli.py", "validate.py", "validate_hf.py", "families/base.py", "families/decoder.py", "families/llama.py",
            "families/qwen3.py", "families/phi3.py", "families/gemma2.py", "families/gemma3.py", "families/gpt2.py",
            "families/course_gpt.py", "families/course_llama.py"} <= set(lengths)
    assert not {"hf.py", "hf_llama.py", "hf_gpt2.py", "parallel_model.py", "model_parallel_cli.py"} & set(lengths)
    assert max(lengths.values()) <= 520, f"a module grew past one sitting: {lengths}"
    assert sorted(p.name for p in (package / "configs").glob("*.json")) == sorted(
        f"{name}.json" for name in C.SHIPPED_CONFIGS)
