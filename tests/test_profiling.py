"""Unit tests of utils.profiling (notebook 06): datasets, worker seeding, data waits, traces, FLOPs, verdicts."""

import json
import time

import numpy as np
import pytest
import torch
from torch.autograd import DeviceType
from torch.profiler import profile, record_function, schedule
from torch.utils.data import DataLoader
from torch.utils.flop_counter import FlopCounterMode

import utils

RANGES = ["data", "forward", "backward"]


# --- datasets and workers ---------------------------------------------------------------------------

def test_synthetic_image_dataset_shapes_and_normalisation():
    dataset = utils.SyntheticImageDataset(6, image_size=12, crop_size=8, num_classes=3, decode_passes=1, seed=1)
    image, label = dataset[0]
    assert len(dataset) == 6 and image.shape == (3, 8, 8) and image.dtype == torch.float32
    assert label.dtype == torch.int64 and 0 <= int(label) < 3
    assert len(dataset.blobs[0]) == 12 * 12 * 3
    assert image.min() >= (0 - 0.5) / 0.25 - 1e-6 and image.max() <= (1 - 0.5) / 0.25 + 1e-6
    again = utils.SyntheticImageDataset(6, image_size=12, crop_size=8, num_classes=3, seed=1)
    assert dataset.blobs == again.blobs and torch.equal(dataset.labels, again.labels), "stored data is seeded"


def test_synthetic_image_dataset_augments_randomly_but_reproducibly():
    dataset = utils.SyntheticImageDataset(2, image_size=16, crop_size=8, decode_passes=0)
    torch.manual_seed(0)
    first = torch.stack([dataset[0][0] for _ in range(6)])
    torch.manual_seed(0)
    second = torch.stack([dataset[0][0] for _ in range(6)])
    assert torch.equal(first, second)
    assert len({crop.numpy().tobytes() for crop in first}) > 1, "crops and flips vary from call to call"


@pytest.mark.parametrize("kwargs, match", [
    ({"num_samples": 0}, "num_samples"), ({"num_samples": 2, "crop_size": 50}, "crop_size"),
    ({"num_samples": 2, "decode_passes": -1}, "decode_passes"), ({"num_samples": 2.5}, "num_samples"),
    ({"num_samples": 2, "image_size": True}, "image_size"),
])
def test_synthetic_image_dataset_bad_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        utils.SyntheticImageDataset(**kwargs)


def test_random_draw_dataset_and_seed_worker_in_workers():
    def by_worker(init=None):
        loader = DataLoader(utils.RandomDrawDataset(4), batch_size=1, num_workers=2,
                            worker_init_fn=init, generator=torch.Generator().manual_seed(0))
        rows = torch.cat(list(loader))
        return rows[rows[:, 1] == 0], rows[rows[:, 1] == 1]

    worker_0, worker_1 = by_worker()
    torch_col, numpy_col, generator_col = (utils.RandomDrawDataset.COLUMNS.index(name)
                                           for name in ("torch", "numpy_global", "numpy_generator"))
    assert not torch.equal(worker_0[:, torch_col], worker_1[:, torch_col])
    assert not torch.equal(worker_0[:, numpy_col], worker_1[:, numpy_col])
    assert torch.equal(worker_0[:, generator_col], worker_1[:, generator_col]), \
        "a generator stored on the dataset is copied into each worker"
    worker_0, worker_1 = by_worker(utils.seed_worker)
    assert not torch.equal(worker_0[:, generator_col], worker_1[:, generator_col])
    main_process = utils.RandomDrawDataset(2)[1]
    assert main_process.shape == (5,) and main_process[0] == 1 and main_process[1] == -1


def test_random_draw_dataset_and_seed_worker_bad_arguments():
    with pytest.raises(ValueError, match="seed"):
        utils.RandomDrawDataset(4, seed=-1)
    with pytest.raises(ValueError, match="num_samples"):
        utils.RandomDrawDataset(0)
    with pytest.raises(ValueError, match="worker_id"):
        utils.seed_worker(-1)


def test_seed_worker_in_the_main_process_seeds_numpy_from_torch():
    torch.manual_seed(123)
    utils.seed_worker(0)
    first = np.random.rand()
    torch.manual_seed(123)
    utils.seed_worker(0)
    assert np.random.rand() == first


# --- DataWaitTimer ------------------------------------------------------------------------------------

class SlowIterable:
    def __init__(self, items, delay_s):
        self.items, self.delay_s = items, delay_s

    def __iter__(self):
        for item in self.items:
            time.sleep(self.delay_s)
            yield item


def test_data_wait_timer_measures_waits_and_work():
    timer = utils.DataWaitTimer(SlowIterable(range(10), 0.004), max_items=4)
    seen = []
    for item in timer:
        seen.append(item)
        time.sleep(0.002)
    assert seen == [0, 1, 2, 3] and len(timer.wait_ms) == len(timer.busy_ms) == 4
    assert min(timer.wait_ms) >= 4.0 and min(timer.busy_ms) >= 2.0
    kept_waits, kept_busy = sum(timer.wait_ms[1:]), sum(timer.busy_ms[1:])
    assert timer.wait_fraction() == pytest.approx(kept_waits / (kept_waits + kept_busy))
    assert timer.steady_step_ms() == pytest.approx((kept_waits + kept_busy) / 3) and timer.total_wait_ms >= 16.0
    assert timer.steady_step_ms(skip=3) == pytest.approx(timer.wait_ms[3] + timer.busy_ms[3])


def test_data_wait_timer_runs_to_the_end_and_resets():
    timer = utils.DataWaitTimer([1, 2, 3])
    assert list(timer) == [1, 2, 3] and len(timer.wait_ms) == 3
    assert list(timer) == [1, 2, 3] and len(timer.wait_ms) == 3, "a second pass starts afresh"


def test_data_wait_timer_bad_input():
    with pytest.raises(TypeError, match="iterable"):
        utils.DataWaitTimer(42)
    with pytest.raises(ValueError, match="max_items"):
        utils.DataWaitTimer([1], max_items=0)
    timer = utils.DataWaitTimer([1])
    list(timer)
    with pytest.raises(ValueError, match="completed items"):
        timer.wait_fraction()
    with pytest.raises(ValueError, match="completed items"):
        timer.steady_step_ms()
    assert timer.wait_fraction(skip=0) >= 0
    with pytest.raises(ValueError, match="skip"):
        timer.steady_step_ms(skip=-1)


# --- profiler results and traces ---------------------------------------------------------------------

@pytest.fixture(scope="module")
def profiled(tmp_path_factory):
    path = tmp_path_factory.mktemp("traces") / "trace.json"
    model = utils.MLP(16, 32, 4)
    with profile(schedule=schedule(wait=1, warmup=1, active=2, repeat=1),
                 on_trace_ready=lambda p: p.export_chrome_trace(str(path))) as prof:
        for _ in range(4):
            with record_function("data"):
                x = torch.randn(8, 16)
            with record_function("forward"):
                loss = model(x).sum()
            with record_function("backward"):
                loss.backward()
            prof.step()
    return prof, path


def test_range_times_and_trace_breakdown_agree(profiled):
    prof, path = profiled
    times = utils.range_times_ms(prof, RANGES)
    assert set(times) == set(RANGES) and all(value > 0 for value in times.values())
    rows = utils.step_breakdown_ms(path, RANGES)
    assert len(rows) == 2
    for row in rows:
        assert row["step"] >= sum(row[name] for name in RANGES) and row["other"] >= 0
    for name in RANGES:
        assert abs(sum(row[name] for row in rows) - times[name]) <= 0.01 * times[name] + 0.05
    events = utils.validate_trace(path, RANGES)
    assert events == sorted(events, key=lambda event: event["ts"])


def test_range_times_bad_input(profiled):
    prof, _ = profiled
    with pytest.raises(TypeError, match="torch.profiler.profile"):
        utils.range_times_ms(object(), RANGES)
    with pytest.raises(TypeError, match="names"):
        utils.range_times_ms(prof, "forward")
    with pytest.raises(TypeError, match="names"):
        utils.range_times_ms(prof, [])
    with pytest.raises(ValueError, match="not recorded"):
        utils.range_times_ms(prof, ["forward", "no_such_range"])


def test_range_times_add_up_a_ranges_host_and_gpu_rows():
    # On CUDA, key_averages() lists a record_function range twice: the host row and a GPU row
    # (gpu_user_annotation) with 0 CPU time, often after it. Neither order may hide the host time.
    class Row:
        def __init__(self, key, cpu_time_total, device_type=DeviceType.CPU):
            self.key, self.cpu_time_total, self.device_type = key, cpu_time_total, device_type

    class FakeProfile:
        def __init__(self, rows):
            self.rows = rows

        def key_averages(self):
            return self.rows

    gpu_row = Row("forward", 0.0, DeviceType.CUDA)
    for rows in ([Row("forward", 1500.0), gpu_row], [gpu_row, Row("forward", 1500.0)],
                 [Row("forward", 1500.0), Row("forward", 700.0, DeviceType.CUDA)]):
        assert utils.range_times_ms(FakeProfile(rows), ["forward"]) == {"forward": 1.5}
    assert utils.range_times_ms(FakeProfile([gpu_row]), ["forward"]) == {"forward": 0.0}


def test_validate_trace_rejects_bad_files(tmp_path, profiled):
    _, path = profiled
    with pytest.raises(ValueError, match="no trace file"):
        utils.validate_trace(tmp_path / "missing.json")
    truncated = tmp_path / "truncated.json"
    truncated.write_text(path.read_text()[:200])
    with pytest.raises(ValueError, match="not valid JSON"):
        utils.validate_trace(truncated)
    with pytest.raises(ValueError, match="traceEvents"):
        utils.validate_trace({"events": []})
    with pytest.raises(ValueError, match="malformed"):
        utils.validate_trace({"traceEvents": [{"ph": "X", "name": "a", "ts": 0}]})
    with pytest.raises(ValueError, match="no complete"):
        utils.validate_trace({"traceEvents": [{"ph": "i", "name": "a", "ts": 0}]})
    with pytest.raises(ValueError, match="lacks the ranges"):
        utils.validate_trace(path, ["optimizer"])
    with pytest.raises(TypeError, match="path"):
        utils.validate_trace(42)


def test_step_breakdown_on_a_hand_written_trace():
    trace = {"traceEvents": [
        {"ph": "X", "name": "ProfilerStep#1", "cat": "user_annotation", "ts": 0, "dur": 1000},
        {"ph": "X", "name": "data", "cat": "user_annotation", "ts": 10, "dur": 600},
        {"ph": "X", "name": "forward", "cat": "user_annotation", "ts": 700, "dur": 200},
        {"ph": "X", "name": "forward", "cat": "gpu_user_annotation", "ts": 700, "dur": 250},
        {"ph": "X", "name": "ProfilerStep#2", "cat": "user_annotation", "ts": 1000, "dur": 500},
        {"ph": "X", "name": "data", "cat": "user_annotation", "ts": 1000, "dur": 100},
        {"ph": "X", "name": "forward", "cat": "user_annotation", "ts": 1200, "dur": 300},
    ]}
    rows = utils.step_breakdown_ms(trace, ["data", "forward"])
    assert rows == [{"data": 0.6, "forward": 0.2, "step": 1.0, "other": pytest.approx(0.2)},
                    {"data": 0.1, "forward": 0.3, "step": 0.5, "other": pytest.approx(0.1)}]
    with pytest.raises(ValueError, match="ProfilerStep"):
        utils.step_breakdown_ms({"traceEvents": trace["traceEvents"][1:4]}, ["data"])


# --- FLOPs and intensity -------------------------------------------------------------------------------

def test_linear_flops_match_flop_counter_mode():
    model = utils.MLP(24, 16, 5, num_hidden_layers=2)
    x = torch.randn(7, 24)
    forward, backward = utils.linear_flops(model, 7)
    assert forward == 2 * 7 * (24 * 16 + 16 * 16 + 16 * 5)
    with FlopCounterMode(display=False) as counter:
        model(x).sum().backward()
    counts = {str(op): flops for op, flops in counter.get_flop_counts()["Global"].items()}
    assert counts["aten.addmm"] == forward and counts["aten.mm"] == backward
    assert backward == 2 * forward - 2 * 7 * 24 * 16
    with_grad = utils.linear_flops(model, 7, input_requires_grad=True)
    assert with_grad == (forward, 2 * forward)


def test_linear_arithmetic_intensity_grows_with_batch():
    model = utils.MLP(64, 64, 64, num_hidden_layers=1)
    small, large = utils.linear_arithmetic_intensity(model, 1), utils.linear_arithmetic_intensity(model, 1024)
    assert small == pytest.approx(2 * 64 * 64 / (4 * (64 * 64 + 128)))
    assert small < 1 < large < 64 * 64 / (2 * 128) + 1e-9
    assert utils.linear_arithmetic_intensity(model, 8, bytes_per_element=2) == \
        pytest.approx(2 * utils.linear_arithmetic_intensity(model, 8))


def test_flops_and_intensity_bad_input():
    with pytest.raises(TypeError, match="nn.Module"):
        utils.linear_flops("mlp", 4)
    with pytest.raises(ValueError, match="no nn.Linear"):
        utils.linear_flops(torch.nn.ReLU(), 4)
    with pytest.raises(ValueError, match="batch_size"):
        utils.linear_flops(utils.MLP(4, 4, 4), 0)
    with pytest.raises(ValueError, match="bytes_per_element"):
        utils.linear_arithmetic_intensity(utils.MLP(4, 4, 4), 4, bytes_per_element=0)


# --- decisions -----------------------------------------------------------------------------------------

def test_workers_needed_and_recommendation():
    assert utils.workers_needed(2.0, 32, 16.0) == 4.0
    assert utils.recommend_num_workers(2.0, 32, 16.0, cpu_count=16) == 4
    assert utils.recommend_num_workers(2.0, 32, 16.0, cpu_count=3) == 2
    assert utils.recommend_num_workers(0.1, 10, 50.0, cpu_count=8) == 1
    assert utils.recommend_num_workers(1.0, 8, 1.0, cpu_count=1) == 0
    assert utils.recommend_num_workers(1.0, 4, 1.0, cpu_count=8, reserved_cores=0) == 4


@pytest.mark.parametrize("args", [(0, 32, 16.0), (2.0, 0, 16.0), (2.0, 32, -1.0), (float("nan"), 32, 1.0),
                                  (True, 32, 1.0)])
def test_workers_needed_bad_input(args):
    with pytest.raises(ValueError):
        utils.workers_needed(*args)


def test_recommend_num_workers_bad_input():
    with pytest.raises(ValueError, match="cpu_count"):
        utils.recommend_num_workers(1.0, 4, 1.0, cpu_count=0)
    with pytest.raises(ValueError, match="reserved_cores"):
        utils.recommend_num_workers(1.0, 4, 1.0, cpu_count=4, reserved_cores=-1)


def test_classify_bottleneck_order_and_bad_input():
    assert utils.classify_bottleneck(0.6, 1.0, 10.0) == "data-bound"
    assert utils.classify_bottleneck(0.6, 100.0, 10.0) == "data-bound", "data comes first"
    assert utils.classify_bottleneck(0.1, 1.0, 10.0) == "bandwidth-bound"
    assert utils.classify_bottleneck(0.1, 100.0, 10.0) == "compute-bound"
    assert utils.classify_bottleneck(0.2, 100.0, 10.0, data_threshold=0.1) == "data-bound"
    assert set(utils.BOTTLENECK_VERDICTS) == {"data-bound", "bandwidth-bound", "compute-bound"}
    with pytest.raises(ValueError, match="data_wait_fraction"):
        utils.classify_bottleneck(1.5, 1.0, 1.0)
    with pytest.raises(ValueError, match="arithmetic_intensity"):
        utils.classify_bottleneck(0.1, 0.0, 1.0)
    with pytest.raises(ValueError, match="machine_balance"):
        utils.classify_bottleneck(0.1, 1.0, float("inf"))
    with pytest.raises(ValueError, match="data_threshold"):
        utils.classify_bottleneck(0.1, 1.0, 1.0, data_threshold=1.0)


def test_trace_file_written_by_export_is_json(profiled):
    _, path = profiled
    assert isinstance(json.loads(path.read_text())["traceEvents"], list)


def test_classify_bottleneck_calls_a_part_overhead_bound_when_its_fixed_costs_exceed_its_roofline_time():
    """Issue 42: a point whose launches alone take longer than the roofline allows for its work is overhead-bound,
    not bandwidth-bound, however low its intensity; data still comes first; both times are needed together."""
    from utils.profiling import OVERHEAD_VERDICT
    assert OVERHEAD_VERDICT == "overhead-bound" and OVERHEAD_VERDICT not in utils.BOTTLENECK_VERDICTS
    assert utils.classify_bottleneck(0.05, 1.0, 8.0, overhead_ms=0.2, roofline_ms=0.08) == "overhead-bound"
    assert utils.classify_bottleneck(0.05, 1.0, 8.0, overhead_ms=0.05, roofline_ms=0.08) == "bandwidth-bound"
    assert utils.classify_bottleneck(0.05, 100.0, 8.0, overhead_ms=0.05, roofline_ms=0.08) == "compute-bound"
    assert utils.classify_bottleneck(0.05, 100.0, 8.0, overhead_ms=0.08, roofline_ms=0.08) == "overhead-bound"
    assert utils.classify_bottleneck(0.5, 1.0, 8.0, overhead_ms=1.0, roofline_ms=0.01) == "data-bound"
    with pytest.raises(ValueError, match="together"):
        utils.classify_bottleneck(0.1, 1.0, 1.0, overhead_ms=0.1)
    with pytest.raises(ValueError, match="roofline_ms"):
        utils.classify_bottleneck(0.1, 1.0, 1.0, overhead_ms=0.1, roofline_ms=0.0)


def test_record_timing_files_a_time_with_its_noise_band(tmp_path, monkeypatch):
    """06 files its times (a sample, a step) with their bands, so that the README shows them as it shows ratios."""
    from tools.readme_results import _value
    monkeypatch.setenv("PYTORCH_INTRO_BUILD_DIR", str(tmp_path))
    results = utils.Results("06_profiling_where_the_time_goes", "cpu")
    timing = utils.Timing("CPU", (10.0, 11.0, 12.0, 13.0, 14.0), warmup=1)
    assert results.record_timing("model_step_ms", timing) == 12.0
    assert results.record_timing("sample_ms", timing, scale=1 / 4) == 3.0
    saved = utils.load_results("06_profiling_where_the_time_goes", tmp_path / "results")["figures"]
    assert saved["model_step_ms"]["unit"] == "ms" and saved["model_step_ms"]["noise"] == pytest.approx(2 / 12)
    assert saved["sample_ms"]["noise"] == pytest.approx(2 / 12), "the band is relative: a per-sample time keeps it"
    assert "±17 %" in _value(saved["model_step_ms"]) and "spread not recorded" not in _value(saved["model_step_ms"])
    with pytest.raises(ValueError, match="scale"):
        results.record_timing("bad", timing, scale=0)


def test_range_median_ms_ignores_one_stretched_call():
    """The overhead twin's time is a median over its calls, so one call a busy machine stretched does not move it."""
    import time as time_module

    from torch.profiler import ProfilerActivity, profile, record_function
    from utils.profiling import range_median_ms
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for pause in (0.002, 0.002, 0.05, 0.002, 0.002):
            with record_function("forward"):
                time_module.sleep(pause)
    assert 1.5 <= range_median_ms(prof, "forward") < 20
    assert utils.range_times_ms(prof, ["forward"])["forward"] >= 50
    with pytest.raises(ValueError, match="no range named 'backward'"):
        range_median_ms(prof, "backward")
    with pytest.raises(TypeError):
        range_median_ms(object(), "forward")
