"""The GPU reference run's plan (tools/gpu_plan.py) and what it installs on an image (tools/gpu_install.py).

The install is proven on two simulated images with Python 3.12 (the GPU machines' version, where this machine has
one): a bare one that holds only torch 2.11 (a stand-in distribution, so nothing large is installed), and one that
already holds some of the packages, as the usual GPU image does. Small wheels built here stand for the carried
``.whl/``: the bare image gets every wheel the requirements lead to, the other only what it lacks, and the
packages import afterwards from the ``--target`` folder the script puts on ``PYTHONPATH``.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from tools import gpu_plan  # noqa: E402
from tools.gpu_plan import PlanError, Step, default_requests, estimate, parse_requests, plan  # noqa: E402

def _python_312() -> str | None:
    """A Python 3.12 interpreter that runs (a pyenv shim may exist without selecting one), or None."""
    import glob
    candidates = [shutil.which("python3.12"), *sorted(glob.glob(os.path.expanduser("~/.pyenv/versions/3.12*/bin/python3.12"))),
                  "/usr/bin/python3.12"]
    for candidate in candidates:
        if candidate and os.path.exists(candidate) and subprocess.run(
                [candidate, "-c", "import sys; assert sys.version_info[:2] == (3, 12)"],
                capture_output=True, timeout=30).returncode == 0:
            return candidate
    return None


PYTHON_312 = _python_312()


# --- the plan ------------------------------------------------------------------------------------------------

def test_default_plan_fills_gaps_first_then_what_changed_then_re_measurements():
    stems = gpu_plan.notebook_stems()
    requests = default_requests(stems, {})
    # nothing filed: full mode for every notebook, by priority; the unit tests after them; no check mode (a full run
    # exercises a notebook's CUDA paths anyway)
    assert [s[:2] for s, mode in requests if mode == "full"] == sorted(
        (s[:2] for s in stems), key=lambda n: (gpu_plan.FULL_PRIORITY + [n]).index(n))
    assert requests[len(stems)] == (gpu_plan.UNIT_TESTS, "check") and len(requests) == len(stems) + 1
    assert default_requests(stems, {}, dry_run=True) == [(s, "check") for s in stems]
    first, second = stems[0], stems[1]
    current = {"status": "ok", "hash": "old prose", "code_hash": gpu_plan.code_hash(first)}
    stale = {"status": "ok", "hash": "old prose", "code_hash": "0" * 16}
    record = {"runs": {first: {"full": dict(current), "check": dict(current)},
                       second: {"full": dict(stale), "check": dict(stale)}},
              "tests": {"status": "ok", "hash": gpu_plan.unit_tests_hash()}}
    requests = default_requests(stems, record)
    assert (first, "full") not in requests and (first, "check") not in requests, "prose edits send nothing back"
    assert (gpu_plan.UNIT_TESTS, "check") not in requests, "the unit tests passed on this code"
    gaps = [r for r in requests if r[0] not in (first, second) and r[1] == "full"]
    assert requests[:len(gaps)] == gaps, "the gaps come first"
    assert requests[len(gaps):] == [(second, "check"), (second, "full")], "then what changed, then re-measuring"


def test_an_entry_without_a_code_hash_is_judged_by_the_file_hash():
    stems = gpu_plan.notebook_stems()
    first = stems[0]
    record = {"runs": {first: {"check": {"status": "ok", "hash": gpu_plan.notebook_hash(first)},
                               "full": {"status": "FAILED", "hash": gpu_plan.notebook_hash(first)}}}}
    requests = default_requests(stems, record)
    assert (first, "full") in requests and requests.index((first, "full")) < len(stems), "failed: a gap, again"
    record["runs"][first]["full"]["status"] = "ok"
    record["runs"][first]["check"]["hash"] = record["runs"][first]["full"]["hash"] = "0" * 16   # changed since
    requests = default_requests(stems, record)
    assert requests[-1] == (first, "full") and (first, "check") in requests


def test_the_code_hash_follows_code_cells_and_the_utils_modules_they_use(tmp_path):
    notebooks, utils_dir = tmp_path / "notebooks", tmp_path / "utils"
    notebooks.mkdir(), utils_dir.mkdir()
    (utils_dir / "__init__.py").write_text('_EXPORTS: dict[str, str] = {"measure_memory": "memory"}\n')
    (utils_dir / "memory.py").write_text("def measure_memory(): pass\n")
    (utils_dir / "plots.py").write_text("def plot(): pass\n")

    def write(code: str, prose: str) -> str:
        cells = [{"cell_type": "markdown", "source": prose, "metadata": {}},
                 {"cell_type": "code", "source": code, "metadata": {}, "outputs": [], "execution_count": None}]
        (notebooks / "00_x.ipynb").write_text(json.dumps({"cells": cells}))
        return gpu_plan.code_hash("00_x", notebooks, utils_dir)

    first = write("utils.measure_memory()", "one sentence")
    assert write("utils.measure_memory()", "another sentence") == first, "prose is not code"
    (utils_dir / "plots.py").write_text("def plot(): return 1\n")
    assert write("utils.measure_memory()", "x") == first, "a module the notebook does not use"
    (utils_dir / "memory.py").write_text("def measure_memory(): return 1\n")
    assert write("utils.measure_memory()", "x") != first, "a module it uses, through utils' exports"


def test_the_current_results_fill_the_capstone_and_checkpointing_first_and_every_gap_before_any_remeasurement():
    """On the H100's record the first call runs 17 and 03 in full mode; the first session's three calls (on one warm
    machine, with its start, within 15 minutes) re-measure nothing while a gap remains; two sessions fill every gap
    and run check mode for every changed notebook (re-measurements of filed figures come last).
    (Eleven full modes were never filed, ~680 s at an H200's speed: more than one session's three calls of 180 s.)"""
    record_path = ROOT / "results" / "nvidia-h100-80gb-hbm3" / "reference_run.json"
    record = json.loads(record_path.read_text())
    stems = gpu_plan.notebook_stems()
    requests = default_requests(stems, record)
    schedule = gpu_plan.plan_calls(requests, gpu_plan.NOTEBOOK_BUDGET_S, check_jobs=4,
                                   factor=gpu_plan.speed_factor("nvidia-h200"), calls=2 * gpu_plan.CALLS)
    first_call = [(s.stem[:2], s.mode) for s in schedule[0]]
    assert ("17", "full") in first_call and ("03", "full") in first_call, first_call
    gaps = {s for s in stems if not gpu_plan.ever_passed(record, s, "full")}
    first_session = [step for call in schedule[:gpu_plan.CALLS] for step in call]
    remeasured = [s.stem for s in first_session if s.mode == "full" and s.stem not in gaps]
    assert not remeasured or gaps <= {s.stem for s in first_session if s.mode == "full"}, \
        f"a re-measurement ({remeasured}) while gaps remain"
    left = [(s.stem, s.mode) for s in schedule[-1] if s.mode == "check" or s.stem in gaps]
    assert not left, f"gaps or check runs left after two sessions: {left} (re-measurements may wait)"
    assert gpu_plan.START_S + gpu_plan.CALLS * (gpu_plan.CALL_BUDGET_S + gpu_plan.CALL_OVERHEAD_S) <= gpu_plan.SESSION_S
    assert all(gpu_plan.estimate(s, "full")[0] <= 90 for s in stems), "every full mode within 90 s on an H100"


def test_an_h200_is_planned_with_the_h100s_estimates_scaled():
    assert gpu_plan.speed_factor("nvidia-h200") < 1 == gpu_plan.speed_factor("nvidia-h100-80gb-hbm3")
    assert gpu_plan.speed_factor("nvidia-a100-sxm4-80gb") == 1.0
    assert estimate("03_x", "full", 0.5)[0] == round(gpu_plan.ESTIMATE_S["03"][1] * 0.5)


def test_requests_keep_their_order_and_modes_and_bad_ones_are_refused():
    stems = gpu_plan.notebook_stems()
    requests = parse_requests(["05:full", "03", f"{stems[0]}:check"], stems)
    assert [(s[:2], m) for s, m in requests] == [("05", "full"), ("03", "full"), (stems[0][:2], "check")]
    assert parse_requests(["03"], stems, dry_run=True)[0][1] == "check"
    with pytest.raises(PlanError, match="no notebook matches '99'"):
        parse_requests(["99"], stems)
    with pytest.raises(PlanError, match="must be one of check, full"):
        parse_requests(["03:fast"], stems)


def test_plan_never_passes_its_budget_and_still_uses_the_time_left():
    budget = estimate("03_x", "full")[0] + estimate("00_x", "check")[0]
    steps, left_over = plan([("03_x", "full"), ("00_x", "check"), ("17_x", "full"), ("01_x", "check")],
                            budget_s=budget)
    assert [s.stem for s in steps] == ["03_x", "00_x"] and [s.stem for s in left_over] == ["17_x", "01_x"]
    assert all(s.limit_s > s.estimate_s for s in steps)
    assert estimate("99_unknown", "full") == (gpu_plan.DEFAULT_ESTIMATE_S[1],
                                              int(gpu_plan.DEFAULT_ESTIMATE_S[1] * gpu_plan.LIMIT_FACTOR))


def test_the_plan_printed_before_a_call_fits_the_call_and_names_each_estimate():
    done = subprocess.run(["bash", str(ROOT / "tools" / "gpu_reference.sh"), "--plan"], cwd=ROOT,
                          capture_output=True, text=True, timeout=60,
                          env={**os.environ, "PYTHON": sys.executable})
    assert done.returncode == 0, done.stderr
    assert "estimate" in done.stdout and "call 2" in done.stdout
    for stem in gpu_plan.notebook_stems():
        assert stem in done.stdout or stem[:2] + ":" in done.stdout, f"{stem} is neither planned nor left over"
    total = int(done.stdout.split("this call: ")[1].split("in about ")[1].split(" s")[0])
    assert total + gpu_plan.SETUP_S + gpu_plan.PACK_RESERVE_S <= gpu_plan.CALL_BUDGET_S


def test_background_steps_cost_their_longest_lane_and_full_mode_waits_for_them():
    """Check-mode runs go four at a time: two of them cost the longer one, and a full run after them waits for it."""
    requests = [("00_x", "check"), ("01_x", "check"), ("03_x", "full")]
    check = [estimate("00_x", "check")[0], estimate("01_x", "check")[0]]
    full_s = estimate("03_x", "full")[0]
    steps, _ = plan(requests, budget_s=max(check) + full_s, check_jobs=4)
    assert [s.stem for s in steps] == ["00_x", "01_x", "03_x"]
    steps, left_over = plan(requests, budget_s=max(check) + full_s - 1, check_jobs=4)
    assert [s.stem for s in left_over] == ["03_x"], "the wait for the background is counted"
    steps, left_over = plan(requests, budget_s=sum(check) + full_s - 1, check_jobs=1)
    assert [s.stem for s in left_over] == ["03_x"]
    assert gpu_plan.wall_seconds(plan(requests, 10_000, check_jobs=4)[0], 4) == max(check) + full_s
    with pytest.raises(PlanError):
        plan(requests, budget_s=100, check_jobs=0)


def test_an_early_exit_still_writes_the_summary(tmp_path):
    (tmp_path / "no-wheels").mkdir()
    done = subprocess.run(["bash", str(ROOT / "tools" / "gpu_reference.sh"), "00:check"], cwd=ROOT,
                          capture_output=True, text=True, timeout=60,
                          env={**os.environ, "PYTHON": sys.executable, "OUT": str(tmp_path / "out"),
                               "GPU_REFERENCE_BUILD": str(tmp_path / "build"),
                               "GPU_REFERENCE_WHEELS": str(tmp_path / "no-wheels")})
    assert done.returncode == 2
    summary = (tmp_path / "out" / "summary.txt").read_text()
    assert "stopped early (exit 2)" in summary


# --- the install on simulated images ---------------------------------------------------------------------------

def _wheel(folder: Path, name: str, version: str, requires: list[str]) -> Path:
    """A minimal, installable wheel: one module printing nothing, its metadata and RECORD."""
    dist_info = f"{name}-{version}.dist-info"
    files = {f"{name}/__init__.py": f"VERSION = {version!r}\n",
             f"{dist_info}/METADATA": "Metadata-Version: 2.1\n" + f"Name: {name}\nVersion: {version}\n"
             + "".join(f"Requires-Dist: {r}\n" for r in requires),
             f"{dist_info}/WHEEL": "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n"}
    files[f"{dist_info}/RECORD"] = "".join(f"{path},,\n" for path in files) + f"{dist_info}/RECORD,,\n"
    path = folder / f"{name}-{version}-py3-none-any.whl"
    with zipfile.ZipFile(path, "w") as archive:
        for member, text in files.items():
            archive.writestr(member, text)
    return path


def _installed_distribution(site: Path, name: str, version: str) -> None:
    """What an image has: a distribution's metadata in a folder on its path."""
    (site / f"{name}-{version}.dist-info").mkdir(parents=True)
    (site / f"{name}-{version}.dist-info" / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\n"
                                                                   f"Version: {version}\n")
    (site / name).mkdir()
    (site / name / "__init__.py").write_text(f"VERSION = {version!r}\n")


@pytest.fixture
def wheelhouse(tmp_path):
    wheels = tmp_path / "whl"
    wheels.mkdir()
    _wheel(wheels, "fakerunner", "2.0", ["fakekernel>=1", "fakeplots", "torch>=2.0", 'fakewin; sys_platform == "win32"'])
    _wheel(wheels, "fakekernel", "1.5", ["fakeplots"])
    _wheel(wheels, "fakeplots", "3.0", ["fakenumbers", "fakeextra; extra == \"docs\""])
    _wheel(wheels, "fakenumbers", "1.0", [])
    _wheel(wheels, "torch", "9.9", [])                          # never installed over the image's own torch
    return wheels


def test_wheels_chosen_on_another_python_follow_the_images_markers(tmp_path):
    """make gpu-wheels runs on this machine's Python; the GPU image's is 3.12, where papermill needs aiohttp: the
    markers are judged for 3.12, and a bare image (Python, torch and BARE_IMAGE_HAS) is told what it lacks."""
    from tools import gpu_install
    wheels = tmp_path / "whl"
    wheels.mkdir()
    _wheel(wheels, "fakerunner", "2.0", ['fakehttp>=3.9; python_version == "3.12"', "numpy", "filelock"])
    index = gpu_install.wheel_index(wheels)
    assert gpu_install.to_install(["fakerunner"], index, python="3.12", bare=True)[1] == ["fakehttp"], \
        "numpy is one of what a bare image must hold; filelock comes with torch"
    assert gpu_install.to_install(["fakerunner"], index, python="3.11", bare=True)[1] == []
    listed = subprocess.run([sys.executable, str(ROOT / "tools" / "gpu_install.py"), "--wheels", str(wheels),
                             "--python", "3.12", "--bare", "--missing", "fakerunner"], capture_output=True, text=True)
    assert listed.returncode == 0 and listed.stdout.split() == ["fakehttp"], listed.stderr


@pytest.mark.skipif(PYTHON_312 is None, reason="no python3.12 on this machine (the GPU machines' version)")
@pytest.mark.parametrize("image", ["bare python 3.12 with torch 2.11 only", "the usual GPU image"])
def test_install_takes_from_the_wheels_only_what_the_image_lacks(tmp_path, wheelhouse, image):
    image_site = tmp_path / "image-site"
    _installed_distribution(image_site, "torch", "2.11.0")
    if image == "the usual GPU image":
        _installed_distribution(image_site, "fakeplots", "2.5")    # an older version the image chose: kept
    env = {"PATH": os.environ["PATH"], "PYTHONPATH": str(image_site), "HOME": str(tmp_path),
           "PYTHONNOUSERSITE": "1"}
    chosen = subprocess.run([PYTHON_312, "-s", str(ROOT / "tools" / "gpu_install.py"),
                             "--wheels", str(wheelhouse), "fakerunner"],
                            capture_output=True, text=True, timeout=60, env=env)
    assert chosen.returncode == 0, chosen.stderr
    names = sorted(Path(line).name.split("-")[0] for line in chosen.stdout.split())
    expected = ["fakekernel", "fakenumbers", "fakeplots", "fakerunner"] if image.startswith("bare") \
        else ["fakekernel", "fakerunner"]
    assert names == expected
    site = tmp_path / "site"
    pip = subprocess.run([PYTHON_312, "-s", "-m", "pip", "install", "--quiet", "--no-index", "--no-deps",
                          "--target", str(site), *chosen.stdout.split()],
                         capture_output=True, text=True, timeout=120, env=env)
    assert pip.returncode == 0, pip.stdout + pip.stderr
    versions = subprocess.run(
        [PYTHON_312, "-s", "-c", "import json, fakerunner, fakekernel, fakeplots, torch; "
         "print(json.dumps([fakeplots.VERSION, torch.VERSION]))"],
        capture_output=True, text=True, timeout=60, env={**env, "PYTHONPATH": f"{site}:{image_site}"})
    assert versions.returncode == 0, versions.stderr
    plots, torch_version = json.loads(versions.stdout)
    assert torch_version == "2.11.0", "the image's torch stays"
    assert plots == ("3.0" if image.startswith("bare") else "2.5")


def test_install_names_what_neither_the_image_nor_the_wheels_have(tmp_path, wheelhouse):
    (wheelhouse / "fakenumbers-1.0-py3-none-any.whl").unlink()
    done = subprocess.run([sys.executable, str(ROOT / "tools" / "gpu_install.py"), "--wheels", str(wheelhouse),
                           "fakerunner"], capture_output=True, text=True, timeout=60)
    assert done.returncode == 1 and "fakenumbers" in done.stderr


def test_the_readme_gives_each_notebooks_estimates_as_the_plan_holds_them():
    readme = (ROOT / "README.md").read_text()
    table = readme.split("<!-- gpu-estimates -->")[1].split("<!-- /gpu-estimates -->")[0]
    rows = {line.split("|")[1].strip(): line for line in table.strip().splitlines()[2:]}
    for stem in gpu_plan.notebook_stems():
        check_s, full_s = gpu_plan.ESTIMATE_S.get(stem[:2], gpu_plan.DEFAULT_ESTIMATE_S)
        assert rows.get(stem[:2]) == f"| {stem[:2]} | {check_s} s | {full_s} s |", \
            f"README's GPU estimates for {stem} differ from tools/gpu_plan.py"
    assert "tools/gpu_reference.sh --plan" in readme and "--unpack" in readme


def test_transformers_and_peft_are_installed_over_another_version_the_image_has(tmp_path, monkeypatch):
    """The calculator's replay is validated against requirements.txt's transformers and peft: an image holding other
    versions gets the carried ones; an image holding the pinned ones, or no wheel carried, keeps the image's."""
    from tools import gpu_install
    wheels = tmp_path / "pinned"
    wheels.mkdir()
    _wheel(wheels, "transformers", "5.24.0", [])
    _wheel(wheels, "fakeplots", "3.0", [])
    image = {"transformers": "5.17.0", "fakeplots": "2.5"}

    def have(name: str, version: str | None = None) -> bool:
        return name in image and (version is None or image[name] == version)

    monkeypatch.setattr(gpu_install, "installed", have)
    chosen, missing = gpu_install.to_install(["transformers", "fakeplots"], gpu_install.wheel_index(wheels))
    assert [w.name.split("-")[0] for w in chosen] == ["transformers"] and missing == []
    image["transformers"] = "5.24.0"
    chosen, _ = gpu_install.to_install(["transformers", "fakeplots"], gpu_install.wheel_index(wheels))
    assert chosen == []
