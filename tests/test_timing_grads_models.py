import time

import pytest
import torch

import utils


def test_time_fn_calls_warmup_plus_repeats_and_measures():
    calls = []

    def sleepy():
        calls.append(1)
        time.sleep(0.002)

    timing = utils.time_fn(sleepy, "cpu", warmup=2, repeats=4)
    assert len(calls) == 6 and len(timing.samples_ms) == 4
    assert timing.median_ms >= 2.0 and timing.min_ms >= 2.0 and timing.spread_ms >= 0
    assert "median" in timing.summary()


def test_time_fn_bad_arguments():
    with pytest.raises(TypeError, match="callable"):
        utils.time_fn(42, "cpu")
    with pytest.raises(ValueError, match="repeats"):
        utils.time_fn(lambda: None, "cpu", repeats=0)
    with pytest.raises(ValueError, match="warmup"):
        utils.time_fn(lambda: None, "cpu", warmup=-1)


def test_time_fn_stops_repeating_at_max_seconds():
    calls = []
    timing = utils.time_fn(lambda: (calls.append(1), time.sleep(0.02)), "cpu", warmup=1, repeats=50, max_seconds=0.05)
    assert 1 <= len(timing.samples_ms) <= 4 and len(calls) == 1 + len(timing.samples_ms)
    once = utils.time_fn(lambda: time.sleep(0.01), "cpu", warmup=0, repeats=5, max_seconds=1e-6)
    assert len(once.samples_ms) == 1, "at least one timed call, even past the limit"
    for bad in (0, -1.0, "2", True):
        with pytest.raises(ValueError, match="max_seconds"):
            utils.time_fn(lambda: None, "cpu", max_seconds=bad)


def test_speedup_is_a_ratio_of_medians_on_one_device():
    slow = utils.Timing("cpu-a", (10.0, 10.0, 10.0), 0)
    fast = utils.Timing("cpu-a", (5.0, 5.0, 5.0), 0)
    assert utils.speedup(slow, fast) == 2.0
    with pytest.raises(ValueError, match="different devices"):
        utils.speedup(slow, utils.Timing("gpu", (1.0,), 0))


def test_gradient_audit_names_parameters_without_gradient():
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
    x = torch.randn(3, 4)
    with torch.no_grad():
        hidden = model[0](x)          # the first layer is cut off from the graph
    model[1](hidden).sum().backward()
    audit = utils.audit_gradients(model)
    assert audit.missing == ("0.weight", "0.bias") and audit.ok == ("1.weight", "1.bias")
    assert not audit.all_ok
    with pytest.raises(AssertionError, match=r"no gradient \(grad is None\) for 2 parameter\(s\): 0.weight, 0.bias"):
        utils.assert_all_parameters_have_gradients(model)


def test_gradient_audit_zero_gradients_and_pass():
    model = torch.nn.Linear(3, 1)
    (model(torch.randn(2, 3)) * 0).sum().backward()
    assert set(utils.audit_gradients(model).zero) == {"weight", "bias"}
    with pytest.raises(AssertionError, match="all-zero"):
        utils.assert_all_parameters_have_gradients(model)
    assert utils.assert_all_parameters_have_gradients(model, allow_zero=True).zero
    model.zero_grad()
    model(torch.randn(2, 3)).sum().backward()
    assert utils.assert_all_parameters_have_gradients(model).all_ok
    with pytest.raises(TypeError):
        utils.audit_gradients([torch.zeros(1)])


def test_parameter_changes():
    model = torch.nn.Linear(2, 2)
    before = utils.snapshot_parameters(model)
    with torch.no_grad():
        model.weight.add_(1.0)
    changes = utils.parameter_changes(before, model)
    assert changes["bias"] == 0.0 and changes["weight"] == pytest.approx(1.0)
    with pytest.raises(ValueError):
        utils.parameter_changes({"other": torch.zeros(1)}, model)


def test_models_shapes_and_validation():
    assert utils.MLP(8, 16, 3, 2)(torch.randn(4, 8)).shape == (4, 3)
    assert utils.SmallConvNet(3, 5, width=4, num_blocks=2)(torch.randn(2, 3, 16, 16)).shape == (2, 5)
    transformer = utils.TinyTransformer(vocab_size=32, d_model=16, num_heads=2, num_layers=2, max_seq_len=8)
    tokens, targets = utils.make_token_data(3, 8, 32)
    assert transformer(tokens).shape == (3, 8, 32) and targets.shape == tokens.shape
    assert len(transformer.blocks) == 2
    with pytest.raises(ValueError, match="positive int"):
        utils.MLP(0, 4, 2)
    with pytest.raises(ValueError, match="divisible"):
        utils.TransformerBlock(10, 3)
    with pytest.raises(ValueError, match="max_seq_len"):
        transformer(torch.zeros(1, 9, dtype=torch.long))
    with pytest.raises(ValueError, match=r"\(batch, seq\)"):
        transformer(torch.zeros(9, dtype=torch.long))


def test_synthetic_data_is_deterministic_and_learnable_shape():
    a = utils.make_classification_data(20, 5, 3, seed=1)
    b = utils.make_classification_data(20, 5, 3, seed=1)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    assert a[1].min() >= 0 and a[1].max() < 3
    with pytest.raises(ValueError):
        utils.make_token_data(0, 4, 4)


def test_flat_gradients_concatenates_and_optionally_zeroes():
    model = torch.nn.Linear(3, 2)
    model(torch.ones(1, 3)).sum().backward()
    flat = utils.flat_gradients(model)
    assert flat.shape == (8,) and torch.equal(flat[:6], torch.ones(6)) and torch.equal(flat[6:], torch.ones(2))
    assert model.weight.grad is not None
    utils.flat_gradients(model, zero=True)
    assert model.weight.grad is None
    with pytest.raises(ValueError, match="no gradient to collect for: weight, bias"):
        utils.flat_gradients(model)
    with pytest.raises(TypeError):
        utils.flat_gradients([torch.zeros(1)])


def test_compare_judges_against_the_noise_of_the_same_run():
    from utils.timing import Timing, compare
    steady = Timing("cpu", (10.0, 10.1, 9.9, 10.0, 10.05), 1)
    twice_as_fast = Timing("cpu", (5.0, 5.05, 4.95, 5.0, 5.02), 1)
    noisy = Timing("cpu", (8.0, 12.0, 9.0, 11.0, 10.0), 1)
    assert compare(steady, twice_as_fast).verdict == "faster"
    assert compare(twice_as_fast, steady).verdict == "slower"
    assert compare(steady, noisy).verdict == "within noise"       # medians equal, spread wide
    assert compare(steady, Timing("cpu", (5.0, 5.0), 0)).verdict == "too few repeats"
    assert "within noise here" in compare(steady, noisy).sentence("b", "a")
    assert compare(steady, twice_as_fast).sentence("b", "a").startswith("b ran 2.00x as fast as a")
    assert compare(twice_as_fast, steady).sentence("b", "a").startswith("b took 2.00x as long as a")  # not 0.50x
    assert "5 repeats each" in compare(steady, noisy).sentence("b", "a")
    assert "at least 5 repeats each" in compare(steady, Timing("cpu", (10.0,) * 7, 0)).sentence("b", "a")
    with pytest.raises(ValueError, match="different devices"):
        compare(steady, Timing("cuda", (1.0,) * 5, 0))


def test_format_band_never_prints_a_narrow_band_as_zero():
    from utils.timing import Timing, compare, format_band
    assert format_band(0.12) == "±12 %"
    assert format_band(0.004) == "±0.4 %"
    assert format_band(0.0) == "±<0.1 %"
    tight = compare(Timing("cpu", (9.98, 9.99, 10.0, 10.01, 10.02), 0),
                    Timing("cpu", (10.1, 10.11, 10.1, 10.09, 10.1), 0))
    assert "noise band ±0.2 %" in tight.sentence("b", "a")
    for bad in (-0.1, float("nan"), "5 %"):
        with pytest.raises(ValueError, match="relative band"):
            format_band(bad)
