"""utils.model_parallel: the checks that run before any process starts, the per-rank predictions, the pipeline's
logical timeline, the ring's split, and the launcher's failure path (one fork server whose ranks exit at once; notebook
13's check-mode run launches the ranks and asserts the measured bytes against these predictions; the GPU-scale
calculator is tested in tests/test_calculator_model_parallel.py)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from utils import model_parallel as mp


def test_default_config_passes_every_check():
    assert mp.check_config(mp.ModelParallelConfig()) == mp.ModelParallelConfig()


@pytest.mark.parametrize("change, fragment", [
    ({"world_size": 3}, "needs 2 ranks, not 3"),
    ({"width": 34, "ffn": 136}, "width = 34 is not divisible by the tensor-parallel degree tp = 4"),
    ({"heads": 2}, "heads = 2 is not divisible"),
    ({"layers": 2}, "4 pipeline stages for 2 layers"),
    ({"layers": 6}, "6 layers do not split evenly into 4 stages"),
    ({"micro_batches": 3}, "3 micro-batches for 4 stages"),
    ({"cp_seq": 20}, "divisible by 2·cp = 8"),
    ({"seq": 18}, "seq = 18 is not divisible by tp = 4"),
])
def test_launch_refuses_bad_layouts_before_starting_a_process(tmp_path, change, fragment):
    config = dataclasses.replace(mp.ModelParallelConfig(), **change)
    with pytest.raises(ValueError, match="expected") as error:
        mp.launch(config, tmp_path / "out")
    assert fragment in str(error.value)
    assert not (tmp_path / "out").exists()


def test_launch_refuses_unknown_parts(tmp_path):
    with pytest.raises(ValueError, match="expected some of"):
        mp.launch(mp.ModelParallelConfig(), tmp_path / "out", parts=["tp", "zero"])


def test_mesh_check_names_the_shapes_that_work():
    assert mp.check_mesh(4, (2, 2)) == (2, 2)
    with pytest.raises(ValueError, match=r"e\.g\. \(1, 6\), \(2, 3\), \(3, 2\), \(6, 1\)"):
        mp.check_mesh(6, (2, 2))
    with pytest.raises(ValueError):
        mp.check_mesh(4, (0, 4))


def test_torch_version_gate():
    mp.check_torch_version("2.13.0+cpu")
    mp.check_torch_version("2.8.0")
    with pytest.raises(RuntimeError, match="hangs on gloo"):
        mp.check_torch_version("2.7.1+cu126")


def test_model_state_prediction_by_layout():
    sharded, replicated, tensors = mp.block_parameter_split(32, 128)
    assert (sharded, replicated, tensors) == (4 * 32 * 32 + 2 * 32 * 128, 128, 10)
    whole = mp.predict_model_state_bytes(sharded, replicated, tensors)
    assert whole == 16 * (sharded + replicated) + 40
    assert mp.predict_model_state_bytes(sharded, replicated, tensors, tp=4) == 16 * (sharded // 4 + replicated) + 40
    assert mp.predict_model_state_bytes(sharded, replicated, tensors, dp=4) == 16 * (sharded + replicated) // 4 + 40
    assert mp.predict_model_state_bytes(sharded, replicated, tensors, dp=2, tp=2) == \
        16 * (sharded // 4 + replicated // 2) + 40
    # ZeRO-1 in mixed precision: 4 bytes of 16-bit weights and gradients whole, 12 divided
    assert mp.predict_model_state_bytes(1000, 0, 0, dp=4, zero=1) == 4 * 1000 + 12 * 1000 // 4
    assert mp.predict_model_state_bytes(1000, 0, 0, dp=4, zero=0) == 16 * 1000
    with pytest.raises(ValueError, match="zero must be 0"):
        mp.predict_model_state_bytes(1000, 0, 0, zero=2)
    with pytest.raises(ValueError):
        mp.predict_model_state_bytes(1000, 0, 0, tp=0)


def test_block_activation_prediction_matches_one_process_to_the_byte():
    config = mp.ModelParallelConfig()
    block = mp.make_block(config)
    counter = mp.SavedActivations(exclude=block)
    with counter.hooks():
        out = block(mp.make_input(config).requires_grad_())
    predicted = mp.predict_block_activation_bytes(config.batch, config.seq, config.width, config.heads, config.ffn)
    assert counter.live == predicted["total"]
    out.sum().backward()
    assert counter.live == 0, "every saved tensor is released by backward"
    assert counter.peak == predicted["total"]


def test_block_activation_prediction_by_layout():
    tp = mp.predict_block_activation_bytes(2, 16, 32, 4, 128, tp=4)
    sp = mp.predict_block_activation_bytes(2, 16, 32, 4, 128, tp=4, sequence_parallel=True)
    one = mp.predict_block_activation_bytes(2, 16, 32, 4, 128)
    assert tp["sharded"] * 4 == one["sharded"] and tp["replicated"] == one["replicated"]
    assert sp["total"] < tp["total"] < one["total"]
    assert sp["gathered"] == 2 * 2 * 16 * 32 * 4            # the norms' outputs, gathered whole
    with pytest.raises(ValueError, match="not divisible"):
        mp.predict_block_activation_bytes(2, 16, 32, 4, 128, tp=3)


def test_collectives_prediction():
    assert mp.predict_collectives(False) == {"forward": {"all_reduce": 2}, "backward": {"all_reduce": 2}}
    assert mp.predict_collectives(True)["forward"] == {"all_gather_into_tensor": 2, "reduce_scatter_tensor": 2}


def gpipe_order(micro_batches: int) -> list[tuple[str, int]]:
    return [("F", i) for i in range(micro_batches)] + [("B", i) for i in range(micro_batches)]


def one_f_one_b_order(stage: int, stages: int, micro_batches: int) -> list[tuple[str, int]]:
    warmup = min(micro_batches, stages - stage)
    order = [("F", i) for i in range(warmup)]
    for i in range(micro_batches - warmup):
        order += [("B", i), ("F", warmup + i)]
    return order + [("B", i) for i in range(micro_batches - warmup, micro_batches)]


@pytest.mark.parametrize("stages, micro_batches", [(2, 2), (4, 4), (4, 6), (3, 8)])
def test_logical_timeline_bubble_equals_the_formula(stages, micro_batches):
    predicted = mp.bubble_fraction(stages, micro_batches)
    assert predicted == (stages - 1) / (micro_batches + stages - 1)
    for orders in ([gpipe_order(micro_batches)] * stages,
                   [one_f_one_b_order(s, stages, micro_batches) for s in range(stages)]):
        timeline = mp.logical_timeline(orders)
        assert len(timeline[0]) == 2 * (micro_batches + stages - 1)
        assert mp.timeline_bubble(timeline) == pytest.approx(predicted, abs=1e-12)


def test_in_flight_counts():
    assert mp.max_in_flight(gpipe_order(6)) == 6 == mp.gpipe_in_flight(2, 4, 6)
    assert [mp.max_in_flight(one_f_one_b_order(s, 4, 6)) for s in range(4)] == [4, 3, 2, 1]
    with pytest.raises(ValueError, match="stage must be in 0..3"):
        mp.gpipe_in_flight(4, 4, 6)


def test_a_deadlocked_order_is_reported():
    with pytest.raises(RuntimeError, match="deadlock"):
        mp.logical_timeline([[("B", 0), ("F", 0)], [("F", 0), ("B", 0)]])


def test_pipeline_checks():
    mp.check_pipeline(8, 4, 4)
    with pytest.raises(ValueError, match="at most one stage per layer"):
        mp.check_pipeline(2, 4, 4)


def test_ring_split_and_work():
    for balanced in (False, True):
        chunks = [mp.sequence_chunks(32, 4, rank, balanced) for rank in range(4)]
        assert sorted(torch.cat(chunks).tolist()) == list(range(32))
    assert mp.sequence_chunks(32, 4, 0, True).tolist() == list(range(4)) + list(range(28, 32))
    assert mp.ring_blocks_per_rank(32, 4, False) == [1, 2, 3, 4]
    assert mp.ring_blocks_per_rank(32, 4, True) == [4, 4, 4, 4]
    contiguous, balanced = mp.ring_work_per_rank(32, 4, False), mp.ring_work_per_rank(32, 4, True)
    assert sum(contiguous) == sum(balanced) == 32 * 33 // 2          # the causal triangle
    assert len(set(balanced)) == 1 and contiguous == sorted(contiguous)
    with pytest.raises(ValueError, match="divisible by 2·cp = 8"):
        mp.sequence_chunks(20, 4, 0, True)


def test_launch_refuses_an_unknown_start_method(tmp_path):
    with pytest.raises(ValueError, match=r"start must be one of \('forkserver', 'spawn'\)"):
        mp.launch(mp.ModelParallelConfig(), tmp_path / "out", start="fork")
    assert not (tmp_path / "out").exists()


def test_fork_server_reports_the_first_failing_rank(tmp_path):
    """The fork server's failure path, without a launch: ranks that reject their arguments exit at once (2), the
    server writes the first one to failure.json, and the launcher's error carries that rank's log."""
    import subprocess
    import sys
    from pathlib import Path

    package = str(Path(mp.__file__).resolve().parent)
    done = subprocess.run([sys.executable, "-c", mp._SERVER_BOOT, package, "2", str(tmp_path), f"--out={tmp_path}",
                           "--no-such-flag"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 1, done.stderr
    error = mp._server_failure(tmp_path, done.returncode)
    assert "failed (exit code 2)" in str(error) and "unrecognized arguments: --no-such-flag" in str(error)
