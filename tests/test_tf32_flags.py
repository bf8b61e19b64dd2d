"""TF32's two APIs must not meet: after the new ``fp32_precision`` flags are set, reading a legacy one raises.

torch 2.9+ switches TF32 with ``torch.backends.cuda.matmul.fp32_precision`` (and ``cudnn.conv`` / ``cudnn.rnn``); once
one of those differs from the rest, ``torch.get_float32_matmul_precision()`` and ``torch.backends.cuda.matmul.
allow_tf32`` raise ("a mix of the legacy and new APIs"). Inductor's max-autotune reads the legacy getter on a GPU,
so a notebook restores the new flags before it compiles. Here: no course code reads or sets a legacy flag, and the
course's own code paths that describe the machine, profile and compile run with the new flags set.
"""
from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
LEGACY = re.compile(r"allow_tf32|get_float32_matmul_precision\(|set_float32_matmul_precision\(")


def _course_code() -> dict[str, str]:
    """Every code cell of the notebooks and every module of utils/ and tools/, by a readable name."""
    code = {str(p.relative_to(ROOT)): p.read_text() for folder in ("utils", "tools") for p in (ROOT / folder).rglob("*.py")}
    for notebook in sorted((ROOT / "notebooks").glob("*.ipynb")):
        cells = json.loads(notebook.read_text())["cells"]
        for index, cell in enumerate(cells):
            if cell["cell_type"] == "code":
                code[f"{notebook.name} cell {index}"] = "".join(cell["source"])
    return code


def test_no_course_code_uses_a_legacy_tf32_flag():
    offenders = [f"{name}: {match.group(0)}" for name, text in _course_code().items()
                 # a line that names "legacy" is a deliberate demonstration of the trap (notebook 04 shows it)
                 for line in text.splitlines() if not line.lstrip().startswith("#") and "legacy" not in line
                 for match in [LEGACY.search(line)] if match]
    assert not offenders, "use the fp32_precision flags (torch 2.9+), not the legacy ones:\n" + "\n".join(offenders)


@pytest.fixture
def new_tf32_flags():
    """The new flags set as a TF32 notebook sets them (matmul TF32, cuDNN conv in IEEE fp32), restored after."""
    saved = (torch.backends.cuda.matmul.fp32_precision, torch.backends.cudnn.conv.fp32_precision)
    torch.backends.cuda.matmul.fp32_precision = "tf32"
    torch.backends.cudnn.conv.fp32_precision = "ieee"
    with pytest.raises(RuntimeError, match="mix of"):       # the trap itself, as torch raises it
        torch.get_float32_matmul_precision()
    yield
    torch.backends.cuda.matmul.fp32_precision, torch.backends.cudnn.conv.fp32_precision = saved


def test_the_course_describes_profiles_and_compiles_with_the_new_flags_set(new_tf32_flags):
    import utils
    from tools.devices import describe_device

    assert "torch" in utils.environment_report("cpu")
    assert describe_device()["name"]
    from torch.profiler import ProfilerActivity, profile, record_function
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        with record_function("step"):
            torch.randn(16, 16) @ torch.randn(16, 16)
    assert prof.key_averages()
    compiled = torch.compile(lambda x: (x @ x).relu(), backend="aot_eager")
    assert compiled(torch.randn(8, 8)).shape == (8, 8)


def test_restoring_the_new_flags_makes_the_legacy_reads_safe_again(new_tf32_flags):
    saved_matmul = "none"
    torch.backends.cuda.matmul.fp32_precision = saved_matmul
    torch.backends.cudnn.conv.fp32_precision = torch.backends.cudnn.rnn.fp32_precision
    assert torch.get_float32_matmul_precision() in ("highest", "high", "medium")
