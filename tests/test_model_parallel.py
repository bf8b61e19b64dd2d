"""utils.model_parallel, utils.pipeline_schedules and utils.parallel_step_time: the checks that run before any
process starts, the per-rank predictions, the collective log (against CommDebugMode), the bucketed reduce, every
pipeline schedule's plan, bubble and memory replay, the layout step-time model, and the launcher's failure path.
Notebook 13's check-mode run launches the ranks and asserts the measured bytes against these predictions; the
GPU-scale calculator is tested in tests/test_calculator_model_parallel.py."""

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
    ({"layers": 12}, "12 layers do not split evenly into 8 stages"),
    ({"chunks": 3}, "8 layers do not split evenly into 12 stages"),
    ({"micro_batches": 6}, "6 micro-batches for the V schedules' 8 stages"),
    ({"micro_batches": 9}, "expected a number of micro-batches divisible by 2"),
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


def test_gpipe_holds_every_micro_batch_and_checks_its_stage():
    assert mp.gpipe_in_flight(2, 4, 6) == 6
    assert mp.bubble_fraction(4, 8) == pytest.approx(3 / 11)
    with pytest.raises(ValueError, match="stage must be in 0..3"):
        mp.gpipe_in_flight(4, 4, 6)


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


def test_launch_refuses_a_non_positive_mesh_model(tmp_path):
    with pytest.raises(ValueError, match="mesh_layers must be a positive int"):
        mp.launch(dataclasses.replace(mp.ModelParallelConfig(), mesh_layers=0), tmp_path / "out")
    assert not (tmp_path / "out").exists()


# --- the collective log, the bucketed reduce, fake ranks ------------------------------------------------------------

@pytest.fixture
def fake_group():
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    def start(world_size: int):
        dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world_size)

    yield start
    if dist.is_initialized():
        dist.destroy_process_group()


def test_collective_log_counts_what_comm_debug_mode_counts_and_sizes_it(fake_group):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.debug import CommDebugMode
    from torch.distributed.tensor.parallel import parallelize_module

    fake_group(2)
    config = mp.ModelParallelConfig()
    block = mp.make_block(config)
    parallelize_module(block, init_device_mesh("cpu", (2,)), mp.tensor_parallel_plan(sequence_parallel=True))
    x = torch.randn(2, 8, 32, requires_grad=True)
    with CommDebugMode() as comm, mp.CollectiveLog() as log:
        out = block(x)
        log.phase("backward")
        mp._local(out).sum().backward()
    assert comm.get_total_counts() == len(log.records) == 8
    assert log.counts() == {("forward", "all_gather"): 2, ("forward", "reduce_scatter"): 2,
                            ("backward", "all_gather"): 2, ("backward", "reduce_scatter"): 2}
    shard, whole = 2 * 8 * 32 * 4, 2 * 16 * 32 * 4
    assert {(r["op"], r["in_bytes"], r["out_bytes"]) for r in log.records} == {
        ("all_gather", shard, whole), ("reduce_scatter", whole, shard)}


def test_collective_log_sees_process_group_calls_and_point_to_point(fake_group):
    import torch.distributed as dist

    fake_group(2)
    with mp.CollectiveLog("mine") as log:
        dist.all_reduce(torch.zeros(10))
        dist.all_gather([torch.zeros(4), torch.zeros(4)], torch.zeros(4))
    assert [(r["phase"], r["op"], r["in_bytes"], r["out_bytes"]) for r in log.records] == [
        ("mine", "all_reduce", 40, 40), ("mine", "all_gather", 16, 32)]


def test_the_sequence_parallel_step_and_its_bucketed_reduce_on_fake_ranks():
    block = mp.make_block(mp.ModelParallelConfig())
    log, out, split = mp.log_training_step(block, mp.tensor_parallel_plan(True), 4, 2, 16)
    counts = log.counts()
    assert counts[("optimizer", "all_reduce")] % 4 == 0 and counts[("optimizer", "all_reduce")] > 0
    assert tuple(out.shape) == (2, 4, 32) and split is block
    log, _, block = mp.log_training_step(mp.make_block(mp.ModelParallelConfig()), mp.tensor_parallel_plan(True), 4, 2,
                                         16, bucketed=True)
    bucket = [r for r in log.records if r["phase"] == "bucketed reduce"]
    assert [(r["op"], r["in_bytes"]) for r in bucket] == [("all_reduce", 4 * 32 * 4)]     # 2 norms x (weight, bias)
    assert not [r for r in log.records if r["phase"] == "optimizer"]
    assert all(not p.grad.placements[0].is_partial() for p in block.parameters())


def test_an_uneven_sequence_is_padded_to_the_largest_shard():
    log, out, _ = mp.log_training_step(mp.make_block(mp.ModelParallelConfig()), mp.tensor_parallel_plan(True), 4, 1, 10)
    gathers = {(r["in_bytes"], r["out_bytes"]) for r in log.records if r["op"] == "all_gather"}
    assert gathers == {(3 * 32 * 4, 4 * 3 * 32 * 4)} and tuple(out.shape) == (1, 3, 32)


def test_log_training_step_caches_by_plan_and_refuses_a_live_group(fake_group):
    cache: dict = {}
    first = mp.log_training_step(mp.LlamaBlock(32, 4, 64), _llama_plan(), 2, 1, 8, cache=cache)
    again = mp.log_training_step(mp.LlamaBlock(32, 4, 64), _llama_plan(), 2, 1, 8, cache=cache)
    assert all(a is b for a, b in zip(again, first)) and len(cache) == 1
    assert mp.plan_signature(_llama_plan()) == mp.plan_signature(_llama_plan()) is not None
    fake_group(2)
    with pytest.raises(RuntimeError, match="expected none initialised"):
        mp.log_training_step(mp.LlamaBlock(32, 4, 64), _llama_plan(), 2, 1, 8)


def _llama_plan() -> dict:
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput, RowwiseParallel,
                                                   SequenceParallel)
    into = PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),))
    return {"input_layernorm": SequenceParallel(), "post_attention_layernorm": SequenceParallel(), "self_attn": into,
            "mlp": into, **{f"self_attn.{p}_proj": ColwiseParallel() for p in "qkv"},
            "self_attn.o_proj": RowwiseParallel(output_layouts=Shard(1)), "mlp.gate_proj": ColwiseParallel(),
            "mlp.up_proj": ColwiseParallel(), "mlp.down_proj": RowwiseParallel(output_layouts=Shard(1))}


def test_saved_activations_leave_no_cycle_when_the_graph_is_retained():
    """A saved *output* kept with its grad_fn would point back at its node: retained graphs (the zero-bubble input
    backward) then never free it. The counter keeps a detached view: dropping the graph frees every byte."""
    counter = mp.SavedActivations()
    x = torch.randn(64, requires_grad=True)
    with counter.hooks():
        y = x.exp().sum()                                   # exp saves its output
    assert counter.live == 64 * 4
    torch.autograd.grad(y, x, retain_graph=True)
    del y
    assert counter.live == 0


# --- pipeline schedules: torch's plans, the bubble, the memory replay ----------------------------------------------

from utils import parallel_step_time as st  # noqa: E402
from utils import pipeline_schedules as ps  # noqa: E402


@pytest.mark.parametrize("name", ["gpipe", "1f1b"])
@pytest.mark.parametrize("stages, micro_batches", [(2, 2), (4, 4), (4, 8), (3, 7)])
def test_one_stage_schedules_idle_the_formula_whatever_backward_costs(name, stages, micro_batches):
    orders = ps.schedule_orders(name, stages, micro_batches)
    for durations in ({"F": 1, "B": 2}, {"F": 1, "B": 1}, {"F": 2, "B": 3}):
        bubble = ps.simulate_schedule(orders, durations).bubble
        assert bubble == pytest.approx((stages - 1) / (micro_batches + stages - 1), abs=1e-12)
    held = [ps.in_flight(orders[s]) for s in range(stages)]
    assert held == ([micro_batches] * stages if name == "gpipe" else
                    [min(micro_batches, stages - s) for s in range(stages)])


def test_interleaved_1f1b_bubble_and_in_flight_across_pipelines():
    for p, v, m in [(2, 2, 4), (4, 2, 8), (4, 2, 2), (4, 3, 6), (4, 2, 10), (3, 4, 1), (8, 2, 16)]:
        orders = ps.schedule_orders("interleaved-1f1b", p, m, v)
        bubble = (p - 1) / (v * m + p - 1) if m >= p else 1 - v * m / (v * p + m - 1)
        assert ps.simulate_schedule(orders).bubble == pytest.approx(bubble, abs=1e-12), (p, v, m)
        per_round = m // max(1, m // p)
        assert [ps.in_flight(orders[r]) for r in range(p)] == \
            [min(v * m, (v - 1) * per_round + 2 * (p - 1 - r) + 1) for r in range(p)], (p, v, m)


@pytest.mark.parametrize("name", [n for n in ps.MULTI_STAGE if n != "interleaved-1f1b"])
def test_zero_bubble_schedules_beat_1f1b_and_hold_each_micro_batch_until_its_weight_backward(name):
    if ps.available_schedules()[name] is None:
        pytest.skip(f"this torch has no {ps.SCHEDULE_CLASSES[name][0]}")
    orders = ps.schedule_orders(name, 4, 8, 2)
    assert ps.simulate_schedule(orders).bubble < ps.one_f_one_b_bubble(4, 8)
    kinds = {a[0] for order in orders.values() for a in order}
    assert {"F", "I", "W"} <= kinds
    for order in orders.values():           # every forward is undone by exactly one B or one W
        assert sum(a[0] == "F" for a in order) == sum(a[0] in ("B", "W") for a in order)


def test_replay_held_bytes_follows_forward_input_and_weight_backwards():
    order = [("F", 0, 0), ("F", 0, 1), ("I", 0, 0), ("W", 0, 0), ("B", 0, 1)]
    assert ps.replay_held_bytes(order, {0: 100}, {0: 30}) == [100, 200, 130, 100, 0]
    with pytest.raises(ValueError, match="needs after_input_backward"):
        ps.replay_held_bytes(order, {0: 100})
    with pytest.raises(ValueError, match="unknown action kind"):
        ps.replay_held_bytes([("X", 0, 0)], {0: 1})


def test_simulation_refuses_bad_orders():
    with pytest.raises(ValueError, match="unknown action kinds"):
        ps.simulate_schedule({0: [("X", 0, 0)]})
    with pytest.raises(ValueError, match="appears twice"):
        ps.simulate_schedule({0: [("F", 0, 0), ("F", 0, 0)]})
    with pytest.raises(RuntimeError, match="deadlock"):
        ps.simulate_schedule({0: [("B", 0, 0), ("F", 0, 0)], 1: [("F", 1, 0), ("B", 1, 0)]})


def test_stage_placement_and_bad_arguments(fake_group):
    assert ps.stage_indices("1f1b", 2, 4) == [2]
    assert ps.stage_indices("interleaved-1f1b", 1, 4, 3) == [1, 5, 9]
    assert ps.stage_indices("zbv", 1, 4, 2) == [1, 6]
    with pytest.raises(ValueError, match="exactly two stages per rank"):
        ps.stage_indices("zbv", 0, 4, 3)
    with pytest.raises(ValueError, match="one stage per rank"):
        ps.stage_indices("1f1b", 0, 4, 2)
    with pytest.raises(ValueError, match="unknown schedule"):
        ps.stage_indices("looped", 0, 4)
    with pytest.raises(ValueError, match="rank must be in 0..3"):
        ps.stage_indices("1f1b", 4, 4)
    with pytest.raises(ValueError, match="multiple of the number of rounds"):
        ps.schedule_orders("interleaved-1f1b", 3, 7, 2)
    fake_group(2)
    with pytest.raises(RuntimeError, match="expected no process group"):
        ps.schedule_orders("zbv", 4, 7, 2)


def test_stage_bytes_reads_the_ranks_records():
    def record(rank):
        return {"rank": rank, "pp": {"zbv": {"after_forward": {str(rank): 10}, "after_input_backward": {str(rank): 7},
                                             "peak_saved_bytes": 20 + rank, "order": [["F", rank, 0]],
                                             "micro_batches": 8, "chunks": 2}}}
    measured = ps.stage_bytes([record(1), record(0)], "zbv")
    assert measured["after_forward"] == {0: 10, 1: 10} and measured["peak"] == [20, 21]
    assert measured["order"] == {0: [("F", 0, 0)], 1: [("F", 1, 0)]}
    with pytest.raises(KeyError, match="did not run 'gpipe'"):
        ps.stage_bytes([record(0)], "gpipe")


# --- the layout step-time model ---------------------------------------------------------------------------------------

SHAPE = st.ModelShape(name="toy", matmul_parameters=8 * 10**9, layers=32, width=4096, heads=32, kv_heads=8)
HARDWARE = st.Hardware(name="test", peak_flops=1e15, nvlink_bytes_per_s=400e9, network_bytes_per_s=50e9,
                       gpus_per_node=8, memory_bytes=80e9, source="stated here")


def test_compute_and_bubble_terms_are_the_formulas():
    workload = st.Workload(seq_len=4096, global_batch=64, checkpointing=False)
    step = st.step_time(SHAPE, st.Layout(pp=4, dp=2), workload, HARDWARE)
    m = 64 // 2
    t_forward = 4096 * 8 * (2 * 8e9 / 32 + 2 * 4096 * 4096) / 1e15
    assert step.micro_batches == m
    assert step.terms["compute"] == pytest.approx(m * 3 * t_forward)
    assert step.terms["bubble"] == pytest.approx(3 * (3 * t_forward + step.terms["pipeline sends"] / m))
    interleaved = st.step_time(SHAPE, st.Layout(pp=4, dp=2, chunks=2), workload, HARDWARE)
    assert interleaved.terms["bubble"] == pytest.approx(step.terms["bubble"] / 2)
    assert step.model_flops == pytest.approx(64 * 4096 * 6 * (8e9 + 32 * 4096 * 4096))


def test_tensor_parallel_traffic_leaves_nvlink_beyond_a_node():
    workload = st.Workload(seq_len=4096, global_batch=16)
    inside = st.step_time(SHAPE, st.Layout(tp=8, dp=2), workload, HARDWARE).terms["tensor parallel"]
    beyond = st.step_time(SHAPE, st.Layout(tp=16, dp=1), workload, HARDWARE).terms["tensor parallel"]
    per_layer = 6 * 2 * 7 / 8 * (4096 * 4096 * 2) / 400e9
    assert inside == pytest.approx(8 * 32 * per_layer)                  # 8 micro-batches per rank, 32 layers
    assert beyond > 5 * inside


def test_fsdp_under_a_pipeline_regathers_for_every_micro_batch():
    def data_parallel(zero, global_batch):
        layout = st.Layout(tp=8, pp=4, dp=16, zero=zero)
        return st.step_time(SHAPE, layout, st.Workload(seq_len=4096, global_batch=global_batch), HARDWARE)
    fsdp = [data_parallel(3, batch).terms["data parallel"] for batch in (64, 128, 256)]
    assert fsdp[2] - fsdp[1] == pytest.approx(2 * (fsdp[1] - fsdp[0])) and fsdp[1] > fsdp[0]   # per micro-batch
    assert data_parallel(1, 256).terms["data parallel"] == pytest.approx(data_parallel(1, 128).terms["data parallel"])


def test_layout_checks_and_refusals():
    with pytest.raises(ValueError, match="expected a multiple of 8"):
        st.step_time(SHAPE, st.Layout(dp=8), st.Workload(seq_len=4096, global_batch=12), HARDWARE)
    with pytest.raises(ValueError, match="at least as many micro-batches as stages"):
        st.step_time(SHAPE, st.Layout(pp=8, dp=4), st.Workload(seq_len=4096, global_batch=16), HARDWARE)
    with pytest.raises(ValueError, match="needs a pipeline"):
        st.Layout(chunks=2)
    with pytest.raises(ValueError, match="zero must be"):
        st.Layout(zero=4)
    with pytest.raises(ValueError, match="heads over tp"):
        st.step_time(SHAPE, st.Layout(tp=64), st.Workload(seq_len=4096, global_batch=64), HARDWARE)
    assert all(layout.gpus == 64 for layout in st.candidate_layouts(64, chunks=(1, 2)))


def test_ranking_puts_fitting_layouts_first_fastest_first():
    from utils.calculator import model_parallel as calc
    model = calc.ParallelModel.from_hf("llama-2-70b")
    memory = {1: 90e9}                                      # ZeRO-1 does not fit, the others do

    def fake_memory(_, layout, __):
        return memory.get(layout.zero, 10e9)
    rows = st.rank_layouts(model, st.candidate_layouts(64, cp_degrees=(1,)),
                           st.Workload(seq_len=4096, global_batch=256), HARDWARE, fake_memory, 72e9)
    fits = [row.fits for row in rows]
    assert fits == sorted(fits, reverse=True) and not all(fits)
    times = [row.step.seconds for row in rows if row.fits]
    assert times == sorted(times)


@pytest.mark.parametrize("pp, chunks", [(4, 2), (8, 4), (16, 4)])
def test_interleaved_in_flight_is_torchs_plan_from_two_rounds_on(pp, chunks):
    for rounds in (1, 2, 4):
        m = rounds * pp
        planned = ps.in_flight(ps.schedule_orders("interleaved-1f1b", pp, m, chunks)[0]) / chunks
        assert st.interleaved_in_flight(pp, chunks, m) == planned
    assert st.interleaved_in_flight(pp, 1, 3 * pp) == pp
