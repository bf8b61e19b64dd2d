"""utils.formats: the format probe, its fake for tests, and the sizes it scales."""
import pytest
import torch

from utils.formats import FAKE_SLOWDOWN_VARIABLE, SLOW_RATIO, FormatSpeed, format_speed


def test_probe_measures_a_positive_ratio():
    speed = format_speed(torch.bfloat16, "cpu", repeats=2)
    assert speed.ratio > 0 and not speed.faked and speed.device == "cpu"
    assert "bf16 matmuls" in speed.sentence()


def test_the_fake_slow_probe_scales_sizes(monkeypatch):
    monkeypatch.setenv(FAKE_SLOWDOWN_VARIABLE, "bfloat16=40,float16=30")
    speed = format_speed(torch.bfloat16, "cpu")
    assert speed.faked and speed.ratio == 40 and speed.slow
    assert speed.scale(60, minimum=12) == 12                 # 60 * 3 / 40 = 4.5, held at the minimum
    assert speed.scale(400, minimum=12) == 30
    assert speed.scale(8, minimum=12) == 8                   # never above the value itself
    assert "faked" in speed.sentence() and "scaled down" in speed.sentence()
    assert format_speed(torch.float16, "cpu").ratio == 30
    assert not format_speed(torch.float64, "cpu").faked      # a format the variable does not name is measured


def test_a_native_format_keeps_its_sizes():
    speed = FormatSpeed(torch.bfloat16, "cpu", 0.25)
    assert not speed.slow and speed.scale(60, minimum=12) == 60
    assert "faster" in speed.sentence()
    assert FormatSpeed(torch.bfloat16, "cpu", SLOW_RATIO).slow


def test_bad_input_is_refused(monkeypatch):
    with pytest.raises(TypeError, match="floating-point"):
        format_speed(torch.int8, "cpu")
    with pytest.raises(ValueError, match="positive ints"):
        FormatSpeed(torch.bfloat16, "cpu", 40.0).scale(0)
    monkeypatch.setenv(FAKE_SLOWDOWN_VARIABLE, "bfloat16:40")
    with pytest.raises(ValueError, match="dtype=ratio"):
        format_speed(torch.bfloat16, "cpu")
