from pathlib import Path

import pytest
import torch

import utils
from utils.env import CHECK_MODE_VARIABLE


@pytest.mark.parametrize("value, expected", [(None, False), ("", False), ("0", False), ("1", True), (" 1 ", True)])
def test_check_mode_accepted_values(monkeypatch, value, expected):
    if value is None:
        monkeypatch.delenv(CHECK_MODE_VARIABLE, raising=False)
    else:
        monkeypatch.setenv(CHECK_MODE_VARIABLE, value)
    assert utils.check_mode() is expected


@pytest.mark.parametrize("value", ["yes", "true", "2", "on", "off"])
def test_check_mode_rejects_unknown_values(monkeypatch, value):
    monkeypatch.setenv(CHECK_MODE_VARIABLE, value)
    with pytest.raises(ValueError, match=f"{CHECK_MODE_VARIABLE}='{value}' is not understood.*use 1"):
        utils.check_mode()


def test_pick_device():
    assert utils.pick_device().type == ("cuda" if torch.cuda.is_available() else "cpu")
    assert utils.pick_device("cpu") == torch.device("cpu")
    with pytest.raises(TypeError, match="prefer must be"):
        utils.pick_device(3)
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="is_available"):
            utils.pick_device("cuda")


def test_environment_report_names_torch_and_device():
    report = utils.environment_report("cpu")
    assert torch.__version__ in report and "threads" in report and "bf16" in report
    native = utils.cpu_bf16_native()
    expected = {True: "bf16: native", False: "bf16: emulated", None: "bf16: runs"}[native]
    assert expected in report and "bf16: yes" not in report, "a CPU's bf16 is native or emulated, not just 'yes'"


@pytest.mark.parametrize("flags,capability,isa,machine,native", [
    ({"avx2", "avx512f", "amx_bf16", "amx_tile"}, "AVX512", "ALL", "x86_64", True),       # a Sapphire Rapids Xeon
    ({"avx2", "avx512f", "avx512_bf16"}, "AVX512", "", "x86_64", True),                   # Cooper Lake, Zen 4
    ({"avx2", "avx512f", "avx512_bf16"}, "AVX512", "AVX512_CORE_AMX", "x86_64", True),
    ({"avx2", "avx512f"}, "AVX512", "ALL", "x86_64", False),                              # Skylake-X: no bf16 unit
    ({"avx2", "fma"}, "AVX2", "ALL", "x86_64", False),                                    # AVX2 only: EPYC Zen 3
    ({"avx2", "avx512f", "amx_bf16"}, "AVX2", "ALL", "x86_64", False),                    # ATEN_CPU_CAPABILITY=avx2
    ({"avx2", "avx512f", "amx_bf16"}, "AVX512", "AVX2", "x86_64", False),                 # ONEDNN_MAX_CPU_ISA=AVX2
    (None, None, None, "arm64", None),                                                    # Apple silicon: unknown
])
def test_cpu_bf16_native_needs_the_instructions_and_kernels_allowed_to_use_them(flags, capability, isa, machine,
                                                                               native):
    assert utils.cpu_bf16_native(flags, capability, isa, machine) is native


def test_cpu_bf16_native_reads_what_this_machine_forces(monkeypatch):
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "AVX2")
    assert utils.cpu_bf16_native({"amx_bf16"}, "AVX512", None, "x86_64") is False
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "avx512_core_bf16")
    assert utils.cpu_bf16_native({"amx_bf16"}, "AVX512", None, "x86_64") is True


def test_seed_everything_repeats_and_rejects_bad_seeds():
    utils.seed_everything(3)
    first = torch.rand(3)
    utils.seed_everything(3)
    assert torch.equal(first, torch.rand(3))
    with pytest.raises(ValueError):
        utils.seed_everything(-1)
    with pytest.raises(TypeError):
        utils.seed_everything(1.5)


def test_build_dir_override(monkeypatch, tmp_path):
    monkeypatch.setenv("PYTORCH_INTRO_BUILD_DIR", str(tmp_path))
    assert utils.build_dir() == tmp_path.resolve()
    monkeypatch.delenv("PYTORCH_INTRO_BUILD_DIR")
    assert utils.build_dir().name == "build"


def test_import_has_no_side_effects():
    """Importing utils (and its calculator) draws no random number, and neither it nor a prediction from a shipped
    transformers config imports transformers or peft (one fresh Python for both: each costs a torch import)."""
    import subprocess
    import sys

    code = ("import sys, torch; torch.manual_seed(123); a = torch.rand(1); torch.manual_seed(123); "
            "import utils, utils.calculator as c; b = torch.rand(1); assert torch.equal(a, b); "
            "c.predict_hf('llama-2-7b', seq_len=64); print('transformers' in sys.modules, 'peft' in sys.modules)")
    done = subprocess.run([sys.executable, "-c", code], cwd=Path(__file__).resolve().parent.parent,
                          capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["False", "False"], "utils, or a prediction from a config, imported transformers/peft"


# --- GPU sizes and formats, on a faked torch.cuda (the bookkeeping, not a real card's numbers) ----------------

class _FakeProperties:
    def __init__(self, total_memory: int) -> None:
        self.total_memory = total_memory


@pytest.fixture
def fake_card(monkeypatch):
    """Make ``torch.cuda`` describe a card of the given size and capability (no CUDA call is made)."""
    def install(total_gb: float, capability: tuple[int, int]) -> torch.device:
        monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device=None: _FakeProperties(int(total_gb * 2**30)))
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
        return torch.device("cuda", 0)
    return install


@pytest.mark.parametrize("total_gib, capability, memory_class, native_bf16", [
    (7.6, (8, 6), 8, True),      # an 8 GB RTX 3070 laptop: torch reports GiB a little under 8 GB
    (14.7, (7, 5), 16, False),   # a Colab T4: 15.8 GB, no native bf16
    (23.6, (8, 9), 24, True),    # an RTX 4090
    (39.4, (8, 0), 40, True),    # an A100 40 GB
    (79.2, (9, 0), 80, True),    # an H100 80 GB
    (139.8, (9, 0), 80, True),   # an H200: the largest class
])
def test_memory_class_and_format_of_common_cards(fake_card, total_gib, capability, memory_class, native_bf16):
    device = fake_card(total_gib, capability)
    assert utils.memory_class_gb(device) == memory_class
    assert utils.supports_bf16(device) is native_bf16
    assert utils.autocast_dtype(device) == (torch.bfloat16 if native_bf16 else torch.float16)
    sizes = {8: "small", 24: "medium", 80: "large"}
    expected = sizes[max(k for k in sizes if k <= memory_class)]
    assert utils.by_memory(device, cpu="cpu", gpu=sizes) == expected


def test_by_memory_on_the_cpu_and_bad_tables(fake_card):
    assert utils.by_memory("cpu", cpu=1, gpu={8: 2}) == 1
    assert utils.memory_class_gb("cpu") is None and utils.device_memory_bytes("cpu") is None
    assert utils.autocast_dtype("cpu") == torch.bfloat16
    with pytest.raises(ValueError, match="hold 8"):
        utils.by_memory("cpu", cpu=1, gpu={16: 2})
    with pytest.raises(ValueError, match="memory classes"):
        utils.by_memory("cpu", cpu=1, gpu={8: 1, 12: 2})
    device = fake_card(3.8, (7, 5))
    with pytest.raises(ValueError, match="at least 8 GB"):
        utils.memory_class_gb(device)
