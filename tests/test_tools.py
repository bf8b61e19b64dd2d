"""The scripts behind `make run` (every notebook runs, failures summarised, wall times recorded),
`make results` (results/<device-slug>/) and the README's generated "What the course measures" section."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import nbformat
import pytest

from tools import readme_results, run_notebooks, save_results
from tools.check_book import external_resources
from tools.devices import cpu_model, describe_device, slugify
from tools.nbtools import ROOT

# --- device names and slugs ----------------------------------------------------------------------


@pytest.mark.parametrize("name, slug", [
    ("NVIDIA H100 80GB HBM3", "nvidia-h100-80gb-hbm3"),
    ("Intel(R) Xeon(R) Platinum 8375C CPU @ 2.90GHz, 2 threads", "intel-xeon-platinum-8375c-cpu-2-90ghz-2-threads"),
    ("AMD EPYC 7B13 64-Core Processor, 16 threads", "amd-epyc-7b13-64-core-16-threads"),
])
def test_slug_is_computed_from_the_device_name(name, slug):
    assert slugify(name) == slug


def test_bad_device_names_are_refused():
    with pytest.raises(ValueError, match="cannot make a folder name"):
        slugify(" (R) !! ")
    with pytest.raises(TypeError):
        slugify(None)


def test_cpu_model_is_read_from_cpuinfo(tmp_path):
    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text("processor\t: 0\nvendor_id\t: AuthenticAMD\nmodel name\t: AMD  EPYC 7B13\n")
    assert cpu_model(cpuinfo) == "AMD EPYC 7B13"
    assert cpu_model(tmp_path / "absent")  # falls back to the platform's answer


def test_this_machine_is_described_with_a_slug():
    device = describe_device("cpu")
    assert device["slug"] == slugify(device["name"]) and device["threads"] >= 1 and device["torch"]


# --- make run: every notebook runs, failures are summarised -------------------------------------


def _notebook(path: Path, *sources: str) -> Path:
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_markdown_cell(f"# {path.stem[:2]} · {path.stem}")]
                                  + [nbformat.v4.new_code_cell(s) for s in sources])
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    nbformat.write(nb, path)
    return path


@pytest.mark.notebook
def test_make_run_runs_every_notebook_and_reports_the_failing_cell(tmp_path, monkeypatch, capsys):
    sources = tmp_path / "notebooks"
    sources.mkdir()
    failing = _notebook(sources / "00_fails.ipynb", "x = 1", "ratio = x / 0  # the failing line", "print('never')")
    passing = _notebook(sources / "01_passes.ipynb", "print('measured 42')")
    build = tmp_path / "build"
    (build / "figures").mkdir(parents=True)
    (build / "figures" / "00_stale.png").write_bytes(b"old")      # left by an earlier run
    monkeypatch.setattr(run_notebooks, "list_notebooks", lambda: [failing, passing])
    monkeypatch.setenv("PYTORCH_INTRO_BUILD_DIR", str(build))
    monkeypatch.setenv("PYTORCH_INTRO_CHECK_MODE", "1")

    assert run_notebooks.main([]) == 1, "a failed notebook makes make run fail"

    out = capsys.readouterr().out
    assert "1 of 2 notebooks failed" in out
    assert "00_fails: cell" in out and "ratio = x / 0" in out, "the summary names the failing cell"
    assert "ZeroDivisionError: division by zero" in out, "and the error"
    assert "01_passes: ok" in out, "the notebook after the failure still ran"
    for stem in ("00_fails", "01_passes"):
        assert (build / "executed" / f"{stem}.ipynb").exists()
        assert (build / "html" / f"{stem}.html").exists(), "HTML is written for every notebook that ran"
    assert "measured 42" in (build / "html" / "01_passes.html").read_text()
    assert external_resources(build / "html") == [], "the HTML pages load nothing from a CDN"
    assert not (build / "figures" / "00_stale.png").exists(), "an earlier run's figures do not survive"
    runtimes = json.loads((build / "runtimes.json").read_text())
    entries = runtimes["modes"]["check"]
    assert entries["00_fails"]["ok"] is False and entries["01_passes"]["ok"] is True
    assert entries["01_passes"]["seconds"] > 0 and entries["01_passes"]["device_slug"] == runtimes["device"]["slug"]


def test_progress_names_each_notebook_the_time_so_far_and_the_estimate(tmp_path):
    results = tmp_path / "results"
    for slug, seconds in (("intel-xeon-2-threads", 30.0), ("nvidia-h100-80gb-hbm3", 5.0)):
        (results / slug).mkdir(parents=True)
        (results / slug / "runtimes.json").write_text(json.dumps({"03_x": {"full": {"seconds": seconds}}}))
    cpu = {"slug": "amd-epyc-avx2-2-threads", "kind": "cpu"}
    assert run_notebooks.reference_seconds("03_x", "full", cpu, results) == (30.0, "intel-xeon-2-threads")
    assert run_notebooks.reference_seconds("03_x", "full", {"slug": "nvidia-h200", "kind": "cuda"},
                                           results) == (5.0, "nvidia-h100-80gb-hbm3")
    assert run_notebooks.reference_seconds("03_x", "check", cpu, results) is None
    notebooks = [Path("03_x.ipynb"), Path("04_y.ipynb")]
    line = run_notebooks.progress_line(0, notebooks, [(30.0, "intel-xeon-2-threads"), None], 125.0)
    assert line == ("[1/2] 03_x: 2.1 min so far; estimate 30 s (intel-xeon-2-threads), about 30 s left in all "
                    "(+1 without a reference)")
    assert "no reference time" in run_notebooks.progress_line(1, notebooks, [None, None], 0.0)


@pytest.mark.parametrize("capability, forced, kind", [("AVX512", "", ""), ("AVX2", "", " (AVX2)"),
                                                     ("AVX2", "avx2", " (AVX2, emulated)")])
def test_a_cpu_without_avx512_files_under_a_folder_of_its_own(capability, forced, kind):
    from tools.devices import cpu_kind
    assert cpu_kind(capability, forced) == kind


def test_make_run_refuses_an_unknown_notebook_name(capsys):
    assert run_notebooks.main(["99_nothing"]) == 2
    assert "no notebook matches ['99_nothing']" in capsys.readouterr().err


# --- results/<device-slug>/ and the README section -----------------------------------------------


def _full_run(build: Path, *, name: str = "AMD EPYC, 2 threads", slug: str = "amd-epyc-2-threads",
              check_mode: bool = False, ok: bool = True) -> Path:
    """A build folder as a full `make run` of two notebooks leaves it."""
    device = {"name": name, "slug": slug, "torch": "2.13.0", "threads": 2}
    (build / "results").mkdir(parents=True)
    (build / "figures").mkdir()
    for stem, value in (("00_measuring_memory_and_time", 200.5), ("01_parameter_footprint", 16.0)):
        figures = {"step_peak_mib": {"name": "step_peak_mib", "value": value, "unit": "MiB", "device": "cpu"},
                   "adamw_fp32_bytes_per_param": {"name": "adamw_fp32_bytes_per_param", "value": 16.0,
                                                  "unit": "bytes/param", "device": "cpu"}}
        (build / "results" / f"{stem}.json").write_text(json.dumps(
            {"notebook": stem, "device": "cpu", "check_mode": check_mode, "figures": figures}))
        (build / "figures" / f"{stem[:2]}_plot.png").write_bytes(b"\x89PNG fake")
    from tools.gpu_plan import code_hash
    entry = {"seconds": 12.3, "ok": ok, "device": device["name"], "device_slug": slug, "finished": "2026-11-23"}
    (build / "runtimes.json").write_text(json.dumps({"device": device, "modes": {"full": {
        "00_measuring_memory_and_time": dict(entry, code_hash=code_hash("00_measuring_memory_and_time")),
        "01_parameter_footprint": dict(entry, seconds=20.0, code_hash=code_hash("01_parameter_footprint"))}}}))
    check = build / "check"
    check.mkdir()
    (check / "runtimes.json").write_text(json.dumps({"device": device, "modes": {"check": {
        "00_measuring_memory_and_time": dict(entry, seconds=4.0, ok=True)}}}))
    return build


def test_results_are_filed_under_the_device_slug_and_feed_the_readme(tmp_path):
    build = _full_run(tmp_path / "build")
    results = tmp_path / "results"
    (results / "amd-epyc-2-threads").mkdir(parents=True)
    (results / "amd-epyc-2-threads" / "notes.md").write_text("mine")
    folder = save_results.save(build, results, build / "check")
    assert folder == results / "amd-epyc-2-threads"
    assert (folder / "notes.md").read_text() == "mine", "files the script does not make are left alone"
    assert sorted(p.name for p in (folder / "figures").iterdir()) == ["00_plot.png", "01_plot.png"]
    assert [r["notebook"] for r in json.loads((folder / "results.json").read_text())] == [
        "00_measuring_memory_and_time", "01_parameter_footprint"]
    times = json.loads((folder / "runtimes.json").read_text())
    assert times["00_measuring_memory_and_time"]["check"]["seconds"] == 4.0
    assert times["01_parameter_footprint"]["full"]["seconds"] == 20.0

    readme = tmp_path / "README.md"
    readme.write_text(f"# Course\n\nintro\n\n{readme_results.COURSE_BEGIN}\nold\n{readme_results.COURSE_END}\n\n"
                      f"## Middle\nkept\n\n{readme_results.BEGIN}\nold\n{readme_results.END}\n\n## After\nkept\n")
    args = ["--readme", str(readme), "--results", str(results)]
    assert readme_results.main([*args, "--check"]) == 1, "a stale section fails the check"
    assert readme_results.main(args) == 0
    text = readme.read_text()
    assert text.startswith("# Course\n\nintro\n\n") and text.endswith("## After\nkept\n"), "only the sections change"
    assert "\n## Middle\nkept\n" in text
    assert "## Start here" in text and "| 00 | **[Measuring memory and time honestly]" in text
    assert "| 00 | peak memory of one AdamW training step, above the model | 200.5 MiB |" in text
    assert "| 01 | bytes per parameter, AdamW in fp32 (predicted 16) | 16 bytes/param |" in text
    assert "| 00_measuring_memory_and_time | 4 s / 12 s |" in text
    assert '<img src="results/amd-epyc-2-threads/figures/00_plot.png"' in text
    assert readme_results.main([*args, "--check"]) == 0

    # a second device gets its own column; a notebook it lacks shows a dash
    other = _full_run(tmp_path / "build2", name="NVIDIA H100 80GB HBM3", slug="nvidia-h100-80gb-hbm3")
    save_results.save(other, results)
    assert readme_results.main([*args, "--check"]) == 1, "new results make the README stale"
    readme_results.main(args)
    assert "| notebook | AMD EPYC, 2 threads | NVIDIA H100 80GB HBM3 |" in readme.read_text()


def test_bad_inputs_are_refused_with_clear_messages(tmp_path, capsys):
    with pytest.raises(save_results.ResultsError, match="run the notebooks first"):
        save_results.save(tmp_path / "no-build", tmp_path / "results")
    with pytest.raises(save_results.ResultsError, match="nothing to file"):
        save_results.save(_full_run(tmp_path / "failed", ok=False), tmp_path / "results")
    with pytest.raises(save_results.ResultsError, match="check-mode|nothing to file"):
        save_results.save(_full_run(tmp_path / "check", check_mode=True), tmp_path / "results")
    with pytest.raises(save_results.ResultsError, match="not a plain folder name"):
        save_results.save(_full_run(tmp_path / "odd", slug="../etc"), tmp_path / "results")
    with pytest.raises(readme_results.ReadmeError, match="does not exist"):
        readme_results.load_devices(tmp_path / "no-results")
    save_results.save(_full_run(tmp_path / "build"), tmp_path / "results")
    with pytest.raises(readme_results.ReadmeError, match="the devices there are: amd-epyc-2-threads"):
        readme_results.load_devices(tmp_path / "results", ["nvidia-a100"])
    readme = tmp_path / "README.md"
    readme.write_text("# no markers\n")
    assert readme_results.main(["--readme", str(readme), "--results", str(tmp_path / "results")]) == 1
    assert "markers" in capsys.readouterr().err and readme.read_text() == "# no markers\n", "nothing is guessed"


def test_a_figure_measured_on_code_that_changed_since_is_marked(tmp_path):
    from tools.gpu_plan import code_hash
    build = _full_run(tmp_path / "build")
    runtimes = json.loads((build / "runtimes.json").read_text())
    runtimes["modes"]["full"]["00_measuring_memory_and_time"]["code_hash"] = code_hash("00_measuring_memory_and_time")
    runtimes["modes"]["full"]["01_parameter_footprint"]["code_hash"] = "0" * 16      # measured on other code
    (build / "runtimes.json").write_text(json.dumps(runtimes))
    results = tmp_path / "results"
    folder = save_results.save(build, results, build / "check")
    assert json.loads((folder / "results.json").read_text())[0]["code_hash"] == code_hash("00_measuring_memory_and_time")
    device, = readme_results.load_devices(results)
    assert device.stale == {"01_parameter_footprint"}
    section = readme_results.render_section([device], tmp_path)
    rows = [line for line in section.splitlines() if line.startswith(("| 00 |", "| 01 |"))]
    assert rows and all(("†" in row) == row.startswith("| 01 |") for row in rows), rows
    assert "earlier version of its notebook's code" in section and "AMD EPYC, 2 threads: 01" in section


def test_course_section_is_read_from_the_notebooks(tmp_path):
    """Titles, pitches and the GPU column come from each notebook's first cell; reading time from its size."""
    notebook = {"cells": [{"cell_type": "markdown", "source": "# 42 · A topic: with a subtitle\n\nThe pitch,\nin two lines."
                           "\n\n- what to do on a GPU: `torch.cuda.synchronize()`"     # not the Prerequisites' GPU
                           "\n\n**Prerequisites**: none. GPU: recommended (tensor cores).", "metadata": {}},
                          {"cell_type": "markdown", "source": " ".join(["word"] * 1000), "metadata": {}},
                          {"cell_type": "code", "source": "x = 1\n\n" * 60, "metadata": {}}]}
    path = tmp_path / "42_a_topic.ipynb"
    path.write_text(json.dumps(notebook))
    info = readme_results.notebook_info(path)
    assert (info.number, info.title, info.pitch, info.gpu) == ("42", "A topic: with a subtitle", "The pitch, in two lines.",
                                                              "recommended")
    assert info.reading_minutes == 15          # 1,000 words at 200 a minute + 60 lines at 10 a minute = 11 -> 15
    section = readme_results.render_course([info], [])
    assert "| 42 | **[A topic: with a subtitle]" in section and "| recommended | 15 min | – / – |" in section
    path.write_text(json.dumps({"cells": [{"cell_type": "markdown", "source": "no title", "metadata": {}}]}))
    with pytest.raises(readme_results.ReadmeError, match="# NN · Title"):
        readme_results.notebook_info(path)


def test_readme_course_section_matches_the_notebooks():
    """README.md's Start here and notebook table are what tools/readme_results.py makes of the notebooks."""
    assert readme_results.main(["--check"]) == 0, "README.md is stale: run `python tools/readme_results.py`"


def test_readme_section_matches_results(tmp_path):
    """The README's "What the course measures" is what tools/readme_results.py makes of results/."""
    readme = tmp_path / "README.md"
    shutil.copyfile(ROOT / "README.md", readme)
    devices = readme_results.load_devices(ROOT / "results")
    _, section, _ = readme_results.split_readme(readme.read_text())
    assert section == readme_results.render_section(devices, ROOT), \
        "README.md's measured section is stale: run `python tools/readme_results.py` (make results does)"


def test_readme_calculator_example_is_what_the_calculator_prints(capsys):
    """The README shows `python -m utils.calculator --preset 7B` and its output: a copy that cannot go stale."""
    from utils import calculator

    text = (ROOT / "README.md").read_text()
    command = "$ python -m utils.calculator --preset 7B\n"
    assert command in text, "README.md shows the calculator's 7B example"
    shown = text.split(command, 1)[1].split("```", 1)[0]
    calculator.main(["--preset", "7B"])
    assert capsys.readouterr().out == shown, "README.md's calculator example is stale: paste the command's output"


def test_readme_marks_timing_figures_with_their_noise_band():
    from tools.readme_results import TIMING_MARK, _value
    timed = {"name": "step_speedup_bf16", "value": 0.9, "unit": "x", "noise": 0.25, "verdict": "within noise"}
    assert _value(timed) == f"{TIMING_MARK} 0.9× ±25 %; within noise"
    unbanded = {"name": "train_step_speedup", "value": 0.97, "unit": "x"}
    assert _value(unbanded).startswith(TIMING_MARK) and "spread not recorded" in _value(unbanded)
    one_off = {"name": "compile_seconds", "value": 21.9, "unit": "s", "verdict": "one compile, not repeated"}
    assert _value(one_off).endswith("(one compile, not repeated)") and "spread not recorded" not in _value(one_off)
    overhead = {"name": "every_block_time_overhead", "value": 0.382, "unit": "fraction", "noise": 0.11,
                "verdict": "slower"}
    assert _value(overhead) == f"{TIMING_MARK} 38.2% ±11 %; slower"
    memory = {"name": "step_peak_mib", "value": 200.25, "unit": "MiB"}
    assert TIMING_MARK not in _value(memory)


def test_results_record_a_comparison_with_its_band(tmp_path, monkeypatch):
    import json
    import utils
    monkeypatch.setenv("PYTORCH_INTRO_BUILD_DIR", str(tmp_path))
    results = utils.Results("00_measuring_memory_and_time", "cpu")
    comparison = utils.compare(utils.Timing("cpu", (10.0,) * 5, 1), utils.Timing("cpu", (5.0,) * 5, 1))
    assert results.record_comparison("speedup", comparison) == 2.0
    saved = json.loads(results.path.read_text())["figures"]["speedup"]
    assert (saved["unit"], saved["noise"], saved["verdict"]) == ("x", 0.0, "faster")


def test_results_record_a_derived_timing_with_the_band_it_was_judged_by(tmp_path, monkeypatch):
    """Notebook 03's overhead (1 / ratio - 1) carries its comparison's band; 05's one compile says why it has none."""
    import json
    import utils
    monkeypatch.setenv("PYTORCH_INTRO_BUILD_DIR", str(tmp_path))
    results = utils.Results("03_activation_checkpointing", "cpu")
    comparison = utils.compare(utils.Timing("cpu", (10.0, 10.5) * 3, 1), utils.Timing("cpu", (14.0, 14.5) * 3, 1))
    results.record("overhead", 1 / comparison.ratio - 1, "fraction", noise=comparison.noise,
                   verdict=comparison.verdict)
    results.record("compile_seconds", 3.2, "s", verdict="one compile, not repeated")
    saved = json.loads(results.path.read_text())["figures"]
    assert (saved["overhead"]["noise"], saved["overhead"]["verdict"]) == (comparison.noise, "slower")
    assert (saved["compile_seconds"]["noise"], saved["compile_seconds"]["verdict"]) == \
        (None, "one compile, not repeated")
    for bad in (-0.1, float("inf"), float("nan"), True, "5 %"):
        with pytest.raises(ValueError, match="noise must be"):
            results.record("x", 1.0, "x", noise=bad)
    with pytest.raises(ValueError, match="verdict must be"):
        results.record("x", 1.0, "x", verdict="")
