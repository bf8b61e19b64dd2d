import json

import pytest
import torch
from matplotlib.figure import Figure

import utils
from utils import results as results_module


@pytest.fixture
def build(monkeypatch, tmp_path):
    monkeypatch.setenv("PYTORCH_INTRO_BUILD_DIR", str(tmp_path))
    return tmp_path


def _measurement():
    model = torch.nn.Linear(8, 8)
    with utils.measure_memory("cpu", phase="forward", include=model) as mem:
        loss = model(torch.randn(4, 8)).sum()
        mem.phase("backward")
        loss.backward()
    return mem


def test_timeline_plot_and_save(build):
    figure = utils.plot_memory_timeline(_measurement(), title="t")
    assert isinstance(figure, Figure) and "CPU" in figure.axes[0].get_title()
    path = utils.save_figure(figure, "unit_timeline")
    assert path == build / "figures" / "unit_timeline.png" and path.stat().st_size > 0
    several = utils.plot_memory_timeline({"a": _measurement(), "b": _measurement()})
    assert len(several.axes[0].lines) == 2


def test_plot_bad_input():
    with pytest.raises(TypeError):
        utils.plot_memory_timeline([1, 2])
    with pytest.raises(ValueError, match="has 1 values for 2 categories"):
        utils.plot_stacked_bars([1, 2], {"x": [1]}, device="d", title="t", xlabel="x")
    with pytest.raises(ValueError, match="figure name"):
        utils.save_figure(Figure(), "../escape")


def test_stacked_bars_are_in_mib():
    figure = utils.plot_stacked_bars([1, 2], {"a": [2**20, 2**20], "b": [2**21, 0]}, device="d", title="t",
                                     xlabel="x", overlay={"peak": [2**22, 2**21]})
    heights = [patch.get_height() for patch in figure.axes[0].patches]
    assert heights == [1.0, 1.0, 2.0, 0.0]


def test_results_record_save_load_and_table(build, capsys):
    results = utils.Results("99_unit", "cpu")
    results.record("peak_mib", 1.5, "MiB")
    results.record("ratio", torch.tensor(2.0), "x")
    loaded = utils.load_results("99_unit")
    assert loaded["figures"]["peak_mib"]["value"] == 1.5 and loaded["figures"]["ratio"]["unit"] == "x"
    assert "CPU" in loaded["figures"]["peak_mib"]["device"]
    assert results_module.main([]) == 0
    out = capsys.readouterr().out
    assert "99_unit" in out and "peak_mib" in out
    assert json.loads((build / "results.json").read_text())[0]["notebook"] == "99_unit"


def test_results_bad_input(build):
    results = utils.Results("99_unit", "cpu")
    with pytest.raises(ValueError, match="finite number"):
        results.record("x", float("nan"), "ms")
    with pytest.raises(ValueError, match="needs a unit"):
        results.record("x", 1.0, "")
    with pytest.raises(ValueError, match="notebook"):
        utils.Results("a/b", "cpu")
    with pytest.raises(FileNotFoundError, match="run the notebook"):
        utils.load_results("98_missing")
    assert results_module.main([]) == 1    # nothing recorded yet in this build dir


def test_the_readme_prints_noise_bands_as_the_notebooks_do():
    import tools.readme_results as readme
    from utils.timing import format_band
    for noise in (0.0, 0.0004, 0.004, 0.0449, 0.05, 0.0999, 0.1, 0.25, 1.3):
        assert readme.format_band(noise) == format_band(noise), noise
