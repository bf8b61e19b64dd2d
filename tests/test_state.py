"""Unit tests of utils.state (RNG capture, the save-interval arithmetic) and utils.resume_demo, which runs
notebook 16's recipe, read from the notebook itself, in fresh namespaces."""

import json
import os
import random
import signal
from pathlib import Path

import numpy as np
import pytest
import torch

import utils
from utils.resume_demo import COMMANDS, Child, flat_weights, recipe_namespace
from utils.state import _fsync_directory

NOTEBOOK = Path(__file__).resolve().parent.parent / "notebooks" / "16_checkpoint_and_resume.ipynb"
RECIPE_CELLS = ("788a7cff", "r1-loader-co", "r1-loop-co", "r1-save-co", "r1-save-co2", "r1-restore-co",
                "948feed4")   # build, the loader, train, state, save, restore, SIGTERM
SETTINGS = {"DEVICE": torch.device("cpu"), "ON_GPU": False, "AMP_DTYPE": torch.bfloat16, "SEED": 0, "DATA_SEED": 1,
            "IN_FEATURES": 8, "HIDDEN_FEATURES": 16, "NUM_CLASSES": 3, "NUM_SAMPLES": 64, "BATCH_SIZE": 16,
            "LR": 3e-3, "WARMUP_STEPS": 2, "TOTAL_STEPS": 7}


def _recipe() -> str:
    """Notebook 16's recipe cells, as the notebook sends them to its children."""
    cells = {c["id"]: "".join(c["source"]) for c in json.loads(NOTEBOOK.read_text())["cells"]}
    return "\n\n".join(cells[cell_id] for cell_id in RECIPE_CELLS)


def test_recipe_namespace_needs_the_recipe_and_its_functions():
    with pytest.raises(TypeError, match="source text"):
        recipe_namespace(b"def f(): pass", SETTINGS)
    with pytest.raises(TypeError, match="mapping"):
        recipe_namespace("x = 1", [("SEED", 0)])
    with pytest.raises(ValueError, match="does not define"):
        recipe_namespace("def make_data():\n    return 1, 2", SETTINGS)
    namespace = recipe_namespace(_recipe(), SETTINGS)
    assert namespace["inputs"].shape == (64, 8) and namespace["DEVICE"] == torch.device("cpu")


def test_the_recipe_resumes_bit_for_bit_and_without_a_piece_it_does_not(tmp_path):
    recipe = recipe_namespace(_recipe(), SETTINGS)
    straight = recipe["make_run"]()
    recipe["train"](*straight, {"step": 0, "epoch": 0, "batch": 0}, SETTINGS["TOTAL_STEPS"])
    first, position = recipe["make_run"](), {"step": 0, "epoch": 0, "batch": 0}
    recipe["train"](*first, position, 5)                       # crosses an epoch: 4 batches per epoch
    state = recipe["training_state"](*first, position)
    recipe["save_atomically"](state, tmp_path / "full.pt")
    assert not list(tmp_path.glob(".*.tmp")), "no temporary file left behind"
    fresh = recipe["training_state"](*recipe["make_run"](), {"step": 0, "epoch": 0, "batch": 0})
    recipe["save_atomically"]({**state, "rng": fresh["rng"]}, tmp_path / "no_rng.pt")
    lines = []
    COMMANDS["resume"](lines.append, recipe=_recipe(), settings=SETTINGS, out=str(tmp_path / "out.pt"),
                       checkpoints={"full": str(tmp_path / "full.pt"), "no RNG": str(tmp_path / "no_rng.pt")})
    outcome = torch.load(tmp_path / "out.pt", weights_only=True)
    assert lines[0].startswith("loaded step 5 in") and lines[-1].startswith("resumed 2 checkpoints")
    assert torch.equal(outcome["full"]["weights"], flat_weights(straight[0]))
    assert outcome["full"]["final_step"] == SETTINGS["TOTAL_STEPS"]
    assert not torch.equal(outcome["no RNG"]["weights"], flat_weights(straight[0]))


def test_the_recipe_restore_refuses_a_file_that_runs_code(tmp_path):
    recipe = recipe_namespace(_recipe(), SETTINGS)
    torch.save({"model": {}, "note": _RunsCode()}, tmp_path / "evil.pt")
    with pytest.raises(Exception, match="Weights only load failed"):
        recipe["restore"](tmp_path / "evil.pt", *recipe["make_run"]())


class _RunsCode:
    def __reduce__(self):
        return os.getpid, ()


def test_write_command_checks_its_arguments(tmp_path):
    with pytest.raises(ValueError, match="mode must be"):
        COMMANDS["write"](print, recipe=_recipe(), settings=SETTINGS, path=str(tmp_path / "x.pt"), mode="sideways")
    with pytest.raises(ValueError, match="megabytes"):
        COMMANDS["write"](print, recipe=_recipe(), settings=SETTINGS, path=str(tmp_path / "x.pt"), mode="atomic",
                          megabytes=0)


def test_train_command_saves_at_a_step_boundary_on_sigterm(tmp_path):
    # in this process: the report callback sends SIGTERM once the recipe's handler is installed
    before = signal.getsignal(signal.SIGTERM)
    lines = []

    def report(line: str) -> None:
        lines.append(line)
        if line == "training":
            os.kill(os.getpid(), signal.SIGTERM)

    COMMANDS["train"](report, recipe=_recipe(), settings=SETTINGS, path=str(tmp_path / "preempted.pt"))
    words = lines[-1].split()
    assert words[0] == "preempted" and int(words[2]) >= 3 and float(words[6]) >= float(words[4]) > 0
    assert torch.load(tmp_path / "preempted.pt", weights_only=True)["position"]["step"] == int(words[2])
    assert signal.getsignal(signal.SIGTERM) == before, "the recipe puts the previous handler back"


def test_fsync_directory_accepts_a_folder(tmp_path):
    _fsync_directory(tmp_path)     # a rename's durability; nothing to observe but that it runs


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


def test_child_rejects_unknown_commands():
    # the child processes themselves run in notebook 16 (a forkserver start is too slow for a unit test)
    with pytest.raises(ValueError, match="command must be one of"):
        Child("sleep")
