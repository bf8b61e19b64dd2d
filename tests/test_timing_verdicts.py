"""`utils.Comparison` in check mode (issue 45): a band wider than the difference says that check mode's sizes are too
small to judge, instead of printing a band of ±200 %; outside check mode, and where the difference clears the band,
the sentence is unchanged."""
from __future__ import annotations

from utils.timing import Comparison, Timing, compare

STEADY = Timing("cpu", (10.0, 10.1, 9.9, 10.0, 10.05), 1)
NOISY = Timing("cpu", (4.0, 30.0, 9.0, 11.0, 25.0), 1)          # band far wider than the 10 % difference
TWICE_AS_FAST = Timing("cpu", (5.0, 5.05, 4.95, 5.0, 5.02), 1)


def test_check_mode_says_the_sizes_are_too_small_where_the_band_is_wider_than_the_effect(monkeypatch):
    monkeypatch.setenv("PYTORCH_INTRO_CHECK_MODE", "1")
    noisy = compare(STEADY, NOISY)
    assert noisy.check_mode and noisy.verdict == "within noise" and noisy.noise > noisy.effect
    assert noisy.too_small_to_judge
    sentence = noisy.sentence("b", "a")
    assert sentence.startswith("b took ") and "too small to judge" in sentence
    assert "noise band" not in sentence and "±" not in sentence, "the meaningless band is not printed"
    clear = compare(STEADY, TWICE_AS_FAST)                       # the difference clears the band: a verdict
    assert not clear.too_small_to_judge and "faster here" in clear.sentence("b", "a")
    assert "too few repeats" in compare(STEADY, Timing("cpu", (5.0, 5.0), 0)).sentence("b", "a")


def test_full_mode_prints_the_band_as_before(monkeypatch):
    monkeypatch.delenv("PYTORCH_INTRO_CHECK_MODE", raising=False)
    noisy = compare(STEADY, NOISY)
    assert not noisy.check_mode and not noisy.too_small_to_judge
    assert "noise band ±" in noisy.sentence("b", "a") and "within noise here" in noisy.sentence("b", "a")


def test_effect_is_on_the_bands_scale_both_ways():
    faster = Comparison(ratio=1.25, noise=0.1, verdict="faster", repeats=5)
    slower = Comparison(ratio=0.8, noise=0.1, verdict="slower", repeats=5)
    assert abs(faster.effect - 0.25) < 1e-12 and abs(slower.effect - 0.25) < 1e-12
    assert not Comparison(ratio=1.05, noise=0.3, verdict="within noise", repeats=5).too_small_to_judge  # not check
    assert Comparison(ratio=1.05, noise=0.3, verdict="within noise", repeats=5, check_mode=True).too_small_to_judge


def test_time_interleaved_calls_round_robin_and_refuses_bad_input():
    """Each round calls every function once, in order, so a drift of the machine lands on every series alike."""
    import pytest

    import utils

    calls = []
    timings = utils.time_interleaved({"a": lambda: calls.append("a"), "b": lambda: calls.append("b")}, "cpu",
                                     warmup=1, repeats=3)
    assert calls == ["a", "b"] * 4
    assert [len(t.samples_ms) for t in timings.values()] == [3, 3] and timings["a"].warmup == 1
    for bad in ({}, {"a": 1}, [lambda: None]):
        with pytest.raises(TypeError, match="non-empty dict"):
            utils.time_interleaved(bad, "cpu")
    with pytest.raises(ValueError, match="repeats"):
        utils.time_interleaved({"a": lambda: None}, "cpu", repeats=0)
