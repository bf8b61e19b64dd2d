import os
import random
import signal

import numpy as np
import pytest
import torch

import utils
from utils.resume_demo import VARIANTS, DemoConfig, DemoRun, flat_weights


def _small_setup():
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Dropout(0.5), torch.nn.Linear(8, 2))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: min(1.0, (step + 1) / 4))
    model(torch.randn(4, 8)).sum().backward()
    optimizer.step()
    scheduler.step()
    return model, optimizer, scheduler


def test_rng_round_trip_covers_python_numpy_torch():
    state = utils.capture_rng_state()
    first = (random.random(), float(np.random.rand()), torch.rand(3))
    utils.restore_rng_state(state)
    second = (random.random(), float(np.random.rand()), torch.rand(3))
    assert first[0] == second[0] and first[1] == second[1] and torch.equal(first[2], second[2])


def test_rng_state_survives_a_weights_only_round_trip(tmp_path):
    state = utils.capture_rng_state()
    expected = (random.random(), float(np.random.rand()), torch.rand(2))
    torch.save(state, tmp_path / "rng.pt")
    utils.restore_rng_state(torch.load(tmp_path / "rng.pt", weights_only=True))
    assert (random.random(), float(np.random.rand())) == expected[:2] and torch.equal(torch.rand(2), expected[2])


def test_restore_rng_state_rejects_bad_input():
    with pytest.raises(TypeError, match="capture_rng_state"):
        utils.restore_rng_state([1, 2])
    with pytest.raises(ValueError, match="lacks"):
        utils.restore_rng_state({"python": random.getstate()})


def test_training_state_round_trip_through_atomic_file(tmp_path):
    model, optimizer, scheduler = _small_setup()
    path = utils.save_checkpoint(utils.capture_training_state(model, optimizer, step=1, scheduler=scheduler,
                                                              data={"epoch": 0, "batch": 1}), tmp_path / "a" / "c.pt")
    assert path.exists() and not list(path.parent.glob(".*.tmp")), "no temporary file left behind"
    state = utils.load_checkpoint(path)
    fresh_model, fresh_optimizer, fresh_scheduler = _small_setup()
    counters = utils.restore_training_state(state, fresh_model, fresh_optimizer, scheduler=fresh_scheduler)
    assert counters["step"] == 1 and counters["data"] == {"epoch": 0, "batch": 1}
    for a, b in zip(model.parameters(), fresh_model.parameters()):
        assert torch.equal(a, b)
    assert fresh_scheduler.state_dict()["last_epoch"] == scheduler.state_dict()["last_epoch"]
    with pytest.raises(utils.CheckpointError, match="scaler was passed in"):
        utils.restore_training_state(state, fresh_model, fresh_optimizer, scaler=torch.amp.GradScaler("cpu"))


def test_capture_training_state_rejects_bad_input():
    model, optimizer, _ = _small_setup()
    with pytest.raises(TypeError, match="nn.Module"):
        utils.capture_training_state("model", optimizer, step=0)
    with pytest.raises(TypeError, match="Optimizer"):
        utils.capture_training_state(model, "adam", step=0)
    with pytest.raises(ValueError, match="step"):
        utils.capture_training_state(model, optimizer, step=-1)


def test_load_checkpoint_gives_clear_errors(tmp_path):
    model, optimizer, _ = _small_setup()
    good = utils.save_checkpoint(utils.capture_training_state(model, optimizer, step=3), tmp_path / "good.pt")
    data = good.read_bytes()
    (tmp_path / "truncated.pt").write_bytes(data[: len(data) // 2])
    (tmp_path / "empty.pt").write_bytes(b"")
    (tmp_path / "text.pt").write_text("not a checkpoint")
    for name in ("truncated.pt", "empty.pt", "text.pt"):
        with pytest.raises(utils.CheckpointError, match="truncated or corrupt"):
            utils.load_checkpoint(tmp_path / name)
    with pytest.raises(FileNotFoundError, match="no checkpoint"):
        utils.load_checkpoint(tmp_path / "missing.pt")
    torch.save({"weights": torch.ones(2)}, tmp_path / "plain.pt")
    with pytest.raises(utils.CheckpointError, match="not a training checkpoint"):
        utils.load_checkpoint(tmp_path / "plain.pt")
    assert torch.equal(utils.load_checkpoint(tmp_path / "plain.pt", training_state=False)["weights"], torch.ones(2))


class _Unlisted:
    """A class torch's safe unpickler does not know."""


def test_load_checkpoint_refuses_unlisted_classes_and_names_the_fix(tmp_path):
    torch.save({"format": "x", "thing": _Unlisted()}, tmp_path / "unlisted.pt")
    with pytest.raises(utils.CheckpointError, match="add_safe_globals"):
        utils.load_checkpoint(tmp_path / "unlisted.pt")


def test_save_checkpoint_in_place_and_bad_path(tmp_path):
    path = utils.save_checkpoint({"a": torch.ones(1)}, tmp_path / "x.pt", atomic=False)
    assert torch.equal(torch.load(path, weights_only=True)["a"], torch.ones(1))
    with pytest.raises(ValueError, match="folder"):
        utils.save_checkpoint({"a": 1}, tmp_path)


def test_async_writer_snapshots_before_the_next_update(tmp_path):
    weights = torch.zeros(1000)
    writer = utils.AsyncCheckpointWriter()
    stall_s = writer.save({"w": weights}, tmp_path / "async.pt")
    weights.add_(1)                       # the next "step" must not leak into the file
    writer.wait()
    assert stall_s >= 0 and writer.last_write_s > 0
    assert torch.equal(torch.load(tmp_path / "async.pt", weights_only=True)["w"], torch.zeros(1000))
    copied = utils.copy_to_cpu({"a": [weights, (weights, 3)]})
    assert copied["a"][1][1] == 3 and copied["a"][0].data_ptr() != weights.data_ptr()


def test_async_writer_reraises_background_errors(tmp_path):
    writer = utils.AsyncCheckpointWriter()
    (tmp_path / "a_file").write_text("x")
    writer.save({"a": 1}, tmp_path / "a_file" / "c.pt")   # its folder cannot be created: fails in the thread
    with pytest.raises(OSError):
        writer.wait()
    writer.wait()                                          # the error is reported once
    with pytest.raises(ValueError, match="folder"):
        writer.save({"a": 1}, tmp_path)


def test_preemption_flag_catches_sigterm_and_restores_the_handler():
    before = signal.getsignal(signal.SIGTERM)
    with utils.PreemptionFlag() as preempted:
        assert not preempted.requested
        os.kill(os.getpid(), signal.SIGTERM)
        assert preempted.requested and preempted.signal_number == signal.SIGTERM
    assert signal.getsignal(signal.SIGTERM) == before
    with pytest.raises(ValueError, match="at least one"):
        utils.PreemptionFlag(signals=())


def test_young_daly_and_overhead():
    assert utils.young_daly_interval(2.0, 3600.0) == pytest.approx(120.0)
    assert utils.young_daly_interval(2.0, 3600.0, daly=True) < 120.0
    assert utils.young_daly_interval(10.0, 1.0, daly=True) == 1.0
    # the first-order overhead is smallest at Young's interval
    best = utils.expected_overhead(120.0, 2.0, 3600.0)
    assert best < utils.expected_overhead(60.0, 2.0, 3600.0) and best < utils.expected_overhead(240.0, 2.0, 3600.0)
    for bad in (0, -1.0, float("nan"), "2", True):
        with pytest.raises(ValueError, match="positive number of seconds"):
            utils.young_daly_interval(bad, 3600.0)
    with pytest.raises(ValueError, match="restart_s"):
        utils.expected_overhead(1.0, 1.0, 1.0, restart_s=-1)


def test_simulation_agrees_with_the_formula_and_is_seeded():
    mean, error = utils.simulate_preemptions(120.0, 2.0, 3600.0, 20 * 3600.0, num_runs=300, seed=1)
    assert mean == pytest.approx(utils.expected_overhead(120.0, 2.0, 3600.0), rel=0.1)
    assert 0 < error < 0.01
    assert utils.simulate_preemptions(120.0, 2.0, 3600.0, 3600.0, num_runs=5, seed=3) == \
        utils.simulate_preemptions(120.0, 2.0, 3600.0, 3600.0, num_runs=5, seed=3)
    with pytest.raises(ValueError, match="num_runs"):
        utils.simulate_preemptions(1.0, 1.0, 1.0, 1.0, num_runs=1)


def test_demo_child_rejects_unknown_commands():
    # the child processes themselves run in notebook 12 (a forkserver start is too slow for a unit test)
    from utils.resume_demo import Child

    with pytest.raises(ValueError, match="command must be one of"):
        Child("sleep")


def test_demo_commands_report_through_a_callback(tmp_path):
    from utils.resume_demo import COMMANDS, ping_command

    lines = []
    ping_command(lines.append)
    assert lines == ["pong"] and set(COMMANDS) == {"resume", "write", "train", "ping"}
    with pytest.raises(ValueError, match="mode must be"):
        COMMANDS["write"](lines.append, path=str(tmp_path / "x.pt"), mode="sideways")


def test_demo_resume_is_bit_exact_in_process_and_dropping_pieces_is_not(tmp_path):
    torch.manual_seed(0)
    config = DemoConfig(total_steps=10, warmup_steps=4, num_samples=96, batch_size=32)
    straight = DemoRun(config)
    straight.train_steps(config.total_steps)
    first = DemoRun(config)
    first.train_steps(5)
    path = utils.save_checkpoint(first.checkpoint(), tmp_path / "demo.pt")
    for name, drop in VARIANTS.items():
        resumed = DemoRun.resume(utils.load_checkpoint(path), drop=drop)
        resumed.train_steps(config.total_steps - resumed.step)
        same = torch.equal(flat_weights(resumed.model), flat_weights(straight.model))
        assert same == (name == "full"), name
    with pytest.raises(ValueError, match="unknown pieces"):
        DemoRun.resume(utils.load_checkpoint(path), drop=("weights",))
    with pytest.raises(ValueError, match="batch_size"):
        DemoConfig(batch_size=64, num_samples=32)
