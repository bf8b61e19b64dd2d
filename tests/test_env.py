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
    import subprocess
    import sys

    code = ("import torch; torch.manual_seed(123); a = torch.rand(1); torch.manual_seed(123); "
            "import utils; b = torch.rand(1); assert torch.equal(a, b)")
    subprocess.run([sys.executable, "-c", code], check=True)
