"""The GPU-only branches of notebooks 04, 05, 06 and 07 (issue 42), run on a CPU through the fake CUDA.

Each test executes the notebook's own cells (taken from the notebook, never copied) with ``DEVICE`` a fake CUDA card
(``tests/fake_cuda.py``): ``FakeCuda.run_as_gpu`` makes the CUDA tensors those cells ask for on the CPU and gives each
kernel the time a stated device model assigns it (a launch cost, matmuls at a rate per format, TF32 while the flag
is on, everything else at the memory bandwidth), which ``utils.time_fn`` reads back through the fake CUDA events. So
a test can assert what the lesson computes from its timings on a GPU (bf16 against TF32 as 04's headline, 06's roofs
and its overhead-bound verdict) to the ratio the model implies; it checks the bookkeeping and the API calls, not any
real card's speed. Sizes are check mode's (``PYTORCH_INTRO_CHECK_MODE=1``).
"""
from __future__ import annotations

import ast
import contextlib
import io
import json
import math

import pytest
import torch

import utils
from fake_cuda import FakeCuda, GpuModel
from recipe_models import notebook_path


def code_cells(prefix: str) -> list[str]:
    """The sources of a notebook's code cells, in order."""
    notebook = json.loads(notebook_path(prefix).read_text())
    return ["".join(c["source"]) for c in notebook["cells"] if c["cell_type"] == "code"]


def cells_between(prefix: str, first: str, last: str) -> list[str]:
    """The code cells from the one containing ``first`` to the one containing ``last``, both included."""
    cells = code_cells(prefix)
    start = next(i for i, source in enumerate(cells) if first in source)
    end = next(i for i, source in enumerate(cells) if last in source and i >= start)
    return cells[start:end + 1]


def only_definitions(source: str) -> bool:
    """Whether a cell only imports, defines functions and classes (so running it alone does no work)."""
    return all(isinstance(node, (ast.Import, ast.ImportFrom, ast.FunctionDef, ast.ClassDef, ast.AnnAssign))
               or isinstance(node, ast.Assign) and isinstance(node.value, (ast.Dict, ast.Constant))
               for node in ast.parse(source).body)


def run_cells(sources: list[str], namespace: dict, name: str = "notebook") -> str:
    """Execute cells in ``namespace``; returns what they printed."""
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        for index, source in enumerate(sources):
            exec(compile(source, f"<{name} cell {index}>", "exec"), namespace)
    return printed.getvalue()


@pytest.fixture
def check_mode_build(monkeypatch, tmp_path):
    """Check mode's sizes, and results and figures written under a temporary build folder."""
    monkeypatch.setenv("PYTORCH_INTRO_CHECK_MODE", "1")
    monkeypatch.setenv("PYTORCH_INTRO_BUILD_DIR", str(tmp_path))
    monkeypatch.delenv("PYTORCH_INTRO_FORMAT_SLOWDOWN", raising=False)
    # 06's set-up cell sets CUBLAS_WORKSPACE_CONFIG on a GPU: registered here, so that it is removed after the test
    monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", "")
    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG")
    return tmp_path


@pytest.fixture(autouse=True)
def restore_precision_flags():
    saved = torch.backends.cuda.matmul.fp32_precision
    yield
    torch.backends.cuda.matmul.fp32_precision = saved


# --- 04: TF32 as a fourth format, and bf16 against TF32 as the headline on a GPU that has it ------------------------

def _run_04_speed_section(fake: FakeCuda, model: GpuModel) -> tuple[dict, str]:
    setup = code_cells("04")[:3]                      # parameters, set-up, the format probe
    recipes = [s for s in code_cells("04") if s.startswith("# Expects from your script")]
    speed = cells_between("04", "def tf32_unavailable_reason", "step_verdict, matmul_verdict")
    namespace = {"math": math}
    with fake.run_as_gpu(model):
        printed = run_cells(setup + recipes + speed, namespace, "04")
    return namespace, printed


@pytest.mark.parametrize("capability", [(9, 0), (8, 0)])
def test_04_times_tf32_as_a_fourth_format_and_sets_bf16_against_it(check_mode_build, monkeypatch, capability):
    fake = FakeCuda(capability=capability, name="Fake H100").install(monkeypatch)
    model = GpuModel(launch_us=0.0, fp32_tflops=50.0, tf32_tflops=400.0, bf16_tflops=800.0, fp16_tflops=800.0)
    ns, printed = _run_04_speed_section(fake, model)
    assert ns["DEVICE"].type == "cuda" and ns["TF32_REASON"] is None
    assert list(ns["SPEED_FORMATS"]) == ["fp32", "tf32", "bf16", "fp16"] and ns["HEADLINE_BASELINE"] == "tf32"
    matmuls = ns["matmul_comparisons"]
    # the modelled rates come back exactly: the TF32 flag was on while tf32 was timed, and only then
    assert matmuls["tf32"].ratio == pytest.approx(400 / 50, rel=1e-6)
    assert matmuls["bf16"].ratio == pytest.approx(800 / 50, rel=1e-6)
    assert matmuls["bf16 over tf32"].ratio == pytest.approx(800 / 400, rel=1e-6)
    steps = ns["step_comparisons"]
    assert set(steps) == {"tf32", "bf16", "fp16", "bf16 over tf32"}
    assert steps["bf16 over tf32"].ratio == pytest.approx(steps["bf16"].ratio / steps["tf32"].ratio, rel=1e-6)
    assert 1 < steps["tf32"].ratio < 400 / 50, "a step is more than its matmuls: TF32 speeds up only those"
    assert torch.backends.cuda.matmul.fp32_precision != "tf32", "the flag is restored after each timing"
    headline = [line for line in printed.splitlines() if line.startswith("- headline")]
    assert headline[0].startswith("- headline: a bf16 matmul ran 2.00x as fast as tf32")
    assert "a bf16 training step" in headline[1] and "as tf32" in headline[1]
    assert any("a TF32 training step" in line for line in printed.splitlines())
    recorded = json.loads((check_mode_build / "results" / "04_mixed_precision.json").read_text())["figures"]
    for name in ("matmul_speedup_bf16_over_tf32", "step_speedup_bf16_over_tf32", "step_speedup_tf32",
                 "step_speedup_bf16", "matmul_speedup_tf32"):
        assert recorded[name]["noise"] is not None and recorded[name]["verdict"], f"{name} filed without its band"
    assert recorded["matmul_speedup_bf16_over_tf32"]["value"] == pytest.approx(2.0, rel=1e-6)
    assert any(name == "Event" for name, _, _ in fake.calls), "GPU timings are read from CUDA events"


def test_04_on_a_gpu_without_tf32_says_why_and_sets_bf16_against_fp32(check_mode_build, monkeypatch):
    fake = FakeCuda(capability=(7, 5), name="Fake T4").install(monkeypatch)
    ns, printed = _run_04_speed_section(fake, GpuModel(launch_us=0.0))
    assert "compute capability 7.5 < 8.0" in ns["TF32_REASON"]
    assert list(ns["SPEED_FORMATS"]) == ["fp32", "bf16", "fp16"] and ns["HEADLINE_BASELINE"] == "fp32"
    assert "bf16 over tf32" not in ns["matmul_comparisons"] and "bf16 over tf32" not in ns["step_comparisons"]
    assert "- TF32: no TF32 on this GPU (compute capability 7.5 < 8.0)" in printed
    assert "bf16 is emulated on this GPU" in printed, "the recipe trains in fp16 there, and the cell says so"
    assert "as fast as fp32" in [line for line in printed.splitlines() if line.startswith("- headline")][0]


def test_04_tf32_switch_restores_the_previous_setting_even_after_an_error():
    cell = next(s for s in code_cells("04") if "def fp32_matmuls_in_tf32" in s)
    assert only_definitions(cell)
    namespace = {"torch": torch}
    exec(cell, namespace)
    torch.backends.cuda.matmul.fp32_precision = "ieee"
    with pytest.raises(ZeroDivisionError):
        with namespace["fp32_matmuls_in_tf32"]():
            assert torch.backends.cuda.matmul.fp32_precision == "tf32"
            1 / 0
    assert torch.backends.cuda.matmul.fp32_precision == "ieee"
    assert torch.get_float32_matmul_precision() == "highest", "the legacy read works again after the block"
    assert "CPU" in namespace["tf32_unavailable_reason"](torch.device("cpu"))


# --- 06: the roofs of each format, and the recommended worker count measured --------------------------------------

def test_06_draws_a_roof_for_fp32_tf32_and_bf16_on_a_gpu_that_has_them(check_mode_build, monkeypatch):
    fake = FakeCuda(capability=(9, 0), name="Fake H100").install(monkeypatch)
    model = GpuModel(launch_us=0.0, fp32_tflops=50.0, tf32_tflops=400.0, bf16_tflops=800.0, bandwidth_gbs=3000.0)
    cells = code_cells("06")
    setup = cells[:2]
    roofs = cells_between("06", "def time_square_matmul", "machine_balance = peak_flops / bandwidth")
    assert only_definitions(roofs[0])
    namespace = {}
    with fake.run_as_gpu(model):
        printed = run_cells(setup + roofs, namespace, "06")
    peaks = namespace["peaks"]
    assert list(peaks) == ["fp32", "tf32", "bf16"] and namespace["tf32_reason"] is None
    assert peaks["tf32"] / peaks["fp32"] == pytest.approx(400 / 50, rel=1e-6), "TF32 on while its roof was timed"
    assert peaks["bf16"] / peaks["fp32"] == pytest.approx(800 / 50, rel=1e-6)
    assert namespace["bandwidth"] == pytest.approx(3000e9, rel=1e-6)
    assert namespace["machine_balance"] == pytest.approx(50e12 / 3000e9, rel=1e-6), "the steps run in fp32"
    assert torch.backends.cuda.matmul.fp32_precision != "tf32"
    assert "tf32 roof" in printed and "bf16 roof" in printed
    recorded = json.loads((check_mode_build / "results" / "06_profiling_where_the_time_goes.json").read_text())
    assert {"peak_matmul_gflops", "peak_matmul_gflops_tf32", "peak_matmul_gflops_bf16"} <= set(recorded["figures"])


def test_06_on_a_gpu_without_tf32_draws_no_tf32_roof(check_mode_build, monkeypatch):
    fake = FakeCuda(capability=(7, 5), name="Fake T4").install(monkeypatch)
    namespace = {}
    with fake.run_as_gpu(GpuModel(launch_us=0.0)):
        printed = run_cells(code_cells("06")[:2] + cells_between("06", "def time_square_matmul",
                                                                 "machine_balance = peak_flops / bandwidth"), namespace)
    assert list(namespace["peaks"]) == ["fp32", "bf16"] and "no TF32 below compute capability 8.0" in printed


def test_06_runs_and_times_the_worker_count_it_recommends(check_mode_build, monkeypatch):
    """Issue 42: the recommended num_workers (here forced to 3, more than the settings compared before it) is run,
    with its first 3 batches left out and enough batches after them for a verdict, and filed with its band."""
    three = lambda *args, **kwargs: 3                          # noqa: E731
    # utils first (what it holds now is the real function), then the module utils loads it from
    monkeypatch.setattr(utils, "recommend_num_workers", three, raising=False)
    monkeypatch.setattr(utils.profiling, "recommend_num_workers", three)
    cells = code_cells("06")
    wanted = [cells[0], cells[1] + "\nWORKER_COUNTS = [0]", cells[2], *cells_between("06", "dataset = utils.Synthetic",
                                                                                    "def train_step(batches")]
    wanted += cells_between("06", "def time_one_batch_of_samples", "def measure_loader")
    wanted += cells_between("06", "cores = os.cpu_count() or 1", "if recommended not in loop:")
    namespace = {}
    printed = run_cells(wanted, namespace, "06")
    assert namespace["recommended"] == 3 and 3 in namespace["loop"]
    timer = namespace["loop"][3]
    assert len(timer.wait_ms) == 3 + namespace["LOADER_STEPS"], "the batches left out, then LOADER_STEPS timed"
    assert len(namespace["loop_timing"][3].samples_ms) == namespace["LOADER_STEPS"] >= 5
    assert "num_workers=3 (recommended), measured" in printed
    recorded = check_mode_build / "results" / "06_profiling_where_the_time_goes.json"
    figures = json.loads(recorded.read_text())["figures"]
    assert figures["step_ms_recommended_workers"]["noise"] is not None
    assert 0 <= figures["wait_share_recommended_workers"]["value"] <= 1


# --- 05: the bf16 transformer step, compiled with its optimizer --------------------------------------------------

def _run_05_transformer_section(monkeypatch, capability, total_memory=80 * 10**9):
    fake = FakeCuda(capability=capability, total_memory=total_memory, name="Fake GPU").install(monkeypatch)
    cells = code_cells("05")
    # the parameters (check mode), the set-up; Dynamo's own backend "eager" here: what is checked is the step's code
    # path on a GPU (its dtype, its compiled optimizer step, its timing on CUDA events), not Inductor's kernels
    setup = [cells[0] + '\nCOMPILE_BACKEND = "eager"', cells[1], cells[2]]
    section = cells_between("05", "LM_DTYPE = torch.bfloat16 if utils.supports_bf16(DEVICE)",
                            "lm_comparison = utils.compare")
    namespace = {"step_comparison": utils.compare(utils.Timing("x", (1.0,) * 5, 0), utils.Timing("x", (1.0,) * 5, 0))}
    with fake.run_as_gpu(GpuModel()):
        printed = run_cells(setup + section, namespace, "05")
    return fake, namespace, printed


def test_05_compiles_a_bf16_transformer_step_with_its_optimizer_on_a_gpu(check_mode_build, monkeypatch):
    compiled_functions = []
    real_compile = torch.compile
    monkeypatch.setattr(torch, "compile", lambda fn, **kw: compiled_functions.append(fn) or real_compile(fn, **kw))
    fake, ns, printed = _run_05_transformer_section(monkeypatch, (9, 0))
    assert ns["DEVICE"].type == "cuda" and ns["LM_DTYPE"] == torch.bfloat16
    optimizer_steps = [fn for fn in compiled_functions if getattr(fn, "__name__", "") == "step"]
    assert any(isinstance(fn, torch.nn.Module) for fn in compiled_functions), "the model is compiled"
    assert optimizer_steps and all(isinstance(fn.__self__, torch.optim.AdamW) for fn in optimizer_steps), \
        "the optimizer step is compiled too"
    assert set(ns["lm_timings"]) == {"eager", "compiled"}
    assert all(len(t.samples_ms) == ns["LM_STEPS"] - ns["WARMUP_STEPS"] >= 5 for t in ns["lm_timings"].values())
    recorded = json.loads((check_mode_build / "results" / "05_torch_compile.json").read_text())["figures"]
    assert recorded["transformer_step_speedup"]["noise"] is not None, "filed with its noise band"
    assert "the compiled bf16 transformer step (optimizer included)" in printed


def test_05_on_a_gpu_without_native_bf16_runs_the_transformer_step_in_fp32_and_says_so(check_mode_build, monkeypatch):
    _, ns, printed = _run_05_transformer_section(monkeypatch, (7, 5), total_memory=16 * 10**9)
    assert ns["LM_DTYPE"] is None
    assert "no native bf16 on this GPU (compute capability below 8.0): the transformer step runs in fp32" in printed
    assert "the compiled fp32 transformer step" in printed


def test_05_transformer_sizes_follow_the_gpu_memory_class(monkeypatch, tmp_path):
    monkeypatch.setenv("PYTORCH_INTRO_CHECK_MODE", "0")
    monkeypatch.setenv("PYTORCH_INTRO_BUILD_DIR", str(tmp_path))
    FakeCuda(capability=(9, 0), total_memory=80 * 10**9).install(monkeypatch)
    namespace = {}
    run_cells(code_cells("05")[:1], namespace)
    sizes = tuple(namespace[name] for name in ("LM_WIDTH", "LM_LAYERS", "LM_SEQ", "LM_BATCH"))
    assert sizes == (1024, 4, 1024, 8)
