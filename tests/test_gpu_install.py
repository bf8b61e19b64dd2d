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

def test_default_plan_checks_every_notebook_first_then_full_mode_by_priority():
    stems = gpu_plan.notebook_stems()
    requests = default_requests(stems, {})
    assert requests[:len(stems)] == [(s, "check") for s in stems], "check mode first, in course order"
    full = [s[:2] for s, mode in requests[len(stems):]]
    assert full[:3] == gpu_plan.FULL_PRIORITY[:3] and sorted(full) == sorted(s[:2] for s in stems)
    assert default_requests(stems, {}, dry_run=True) == [(s, "check") for s in stems]


def test_the_next_call_runs_what_is_still_missing(tmp_path):
    stems = gpu_plan.notebook_stems()
    first = stems[0]
    record = {"runs": {first: {"check": {"status": "ok", "hash": gpu_plan.notebook_hash(first)},
                               "full": {"status": "FAILED", "hash": gpu_plan.notebook_hash(first)}}}}
    requests = default_requests(stems, record)
    assert (first, "check") not in requests and (first, "full") in requests, "passed: skipped; failed: again"
    record["runs"][first]["check"]["hash"] = "0" * 16            # the notebook changed since it passed
    assert (first, "check") in default_requests(stems, record)


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
    steps, left_over = plan([("03_x", "full"), ("00_x", "check"), ("15_x", "full")], budget_s=250)
    assert [s.stem for s in steps] == ["03_x", "00_x"] and [s.stem for s in left_over] == ["15_x"]
    assert sum(s.estimate_s for s in steps) <= 250
    assert all(s.limit_s > s.estimate_s for s in steps)
    assert estimate("99_unknown", "full") == (gpu_plan.DEFAULT_ESTIMATE_S[1],
                                              int(gpu_plan.DEFAULT_ESTIMATE_S[1] * gpu_plan.LIMIT_FACTOR))


def test_the_plan_printed_before_a_call_fits_eight_minutes_and_names_each_estimate():
    """The issue's "done when": the one call's plan, printed on the CPU, within 8 minutes of command time."""
    done = subprocess.run(["bash", str(ROOT / "tools" / "gpu_reference.sh"), "--plan"], cwd=ROOT,
                          capture_output=True, text=True, timeout=60,
                          env={**os.environ, "PYTHON": sys.executable})
    assert done.returncode == 0, done.stderr
    assert "estimate" in done.stdout
    for stem in gpu_plan.notebook_stems():
        assert stem in done.stdout or stem[:2] + ":" in done.stdout, f"{stem} is neither planned nor left over"
    total = int(done.stdout.split("in about ")[1].split(" s")[0])
    assert total + 25 + 25 <= 8 * 60, "installing + notebooks (check mode several at a time) + packing within 8 minutes"


def test_check_mode_runs_several_at_a_time_and_full_mode_one_at_a_time():
    """Four check-mode runs at a time cost a quarter of their estimates in the plan; full mode is never shortened."""
    requests = [("00_x", "check"), ("01_x", "check"), ("03_x", "full")]
    check_s = estimate("00_x", "check")[0] + estimate("01_x", "check")[0]
    full_s = estimate("03_x", "full")[0]
    steps, _ = plan(requests, budget_s=check_s / 4 + full_s, check_jobs=4)
    assert [s.stem for s in steps] == ["00_x", "01_x", "03_x"]
    steps, left_over = plan(requests, budget_s=check_s + full_s - 1, check_jobs=1)
    assert [s.stem for s in left_over] == ["03_x"]
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
