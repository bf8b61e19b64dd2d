#!/usr/bin/env bash
# The GPU reference run in one call: on a CUDA machine that has Python and torch but no Jupyter.
#
#   tools/gpu_reference.sh                     the default call: full mode for the notebooks never filed on this GPU,
#                                              then the unit tests and check mode for what changed since it passed, then
#                                              re-measurements (tools/gpu_plan.py), less what already passed on this GPU
#                                              (results/<gpu>/reference_run.json): three calls complete the set
#   tools/gpu_reference.sh unit-tests          the unit tests that run CUDA branches and the calculator's CUDA grid
#   tools/gpu_reference.sh NN[:check|:full] …  those notebooks, in that order (a bare NN: full mode)
#   tools/gpu_reference.sh --plan [NN …]       print the plan with each notebook's estimated time, run nothing
#   tools/gpu_reference.sh --dry-run [NN ...]  the same on this machine: the local .venv, check mode, no install
#   tools/gpu_reference.sh --wheels [--bare]   (here, with network) download the wheels into .whl/ (make gpu-wheels):
#                                              what the usual GPU image lacks, or (--bare) everything a Python 3.12
#                                              image with torch, numpy, pillow and matplotlib lacks (about 50 MB:
#                                              within the 64 MiB a call carries with the tree)
#   tools/gpu_reference.sh --unpack DIR        (here) file what a run packed into DIR under results/<device>/
#
# A run: makes a venv that sees the image's own packages (--system-site-packages) and installs into it, from the
# wheels carried in .whl/, only what the image lacks (checked package by package); writes the environment (GPU,
# driver, CUDA, torch); runs the unit tests that exercise CUDA paths; runs each planned notebook with
# tools/run_notebooks.py under its own time limit and a total budget (a device call lasts at most 10 minutes, and
# 8 minutes of command time is what fits a lent GPU's 15 minutes with its start); files the full-mode figures with
# tools/save_results.py (like `make results`, onto a copy of results/); and packs everything into $OUT (at most
# 8 files: summary.txt, reference.tar.gz, and the executed notebooks in executed.tar.gz or its parts), repacking
# after every notebook so a run cut short still returns what it did. It prints a one-screen summary and exits
# non-zero only for an infrastructure failure (2: setup or usage, 3: no GPU, 4: the runner itself crashed,
# 5: packing failed), never because a notebook failed or ran out of time: the summary says that. summary.txt is
# written on every exit, an early one included (it then says where the run stopped).
#
# Variables: OUT (where the pack goes; default build/gpu-reference-out, or build/gpu-reference-dry-out),
# GPU_REFERENCE_BUDGET_S (total seconds of the command, default 470), GPU_REFERENCE_NOTEBOOK_TIMEOUT_S (a cap on any
# notebook's own limit, default 330), GPU_REFERENCE_TESTS_TIMEOUT_S (default 45), GPU_REFERENCE_PYTEST_ARGS (the unit
# tests; empty or --no-tests: none),
# GPU_REFERENCE_CALCULATOR_ARGS (the memory calculator's grid measured on this device, `python -m utils.calculator
# ARGS`; default --validate --on cuda, in a dry run --validate --check --on cpu; empty or --no-tests: none),
# GPU_REFERENCE_DRY_RUN=1 (= --dry-run), PYTHON (the interpreter), GPU_REFERENCE_BUILD (the work folder),
# GPU_REFERENCE_WHEELS (default .whl/), GPU_REFERENCE_RESULTS (the results/ folder filed onto and unpacked into),
# GPU_REFERENCE_RUNS (where --unpack puts whole runs, default build/gpu-reference-runs), GPU_REFERENCE_PART_MIB
# (size of executed.tar.gz's parts, 15), GPU_REFERENCE_RETURN_MIB (what $OUT may hold in all, 64: a device call's
# limit), and, for tests only, GPU_REFERENCE_RUNNER (a command run as
# `RUNNER STEM` instead of tools/run_notebooks.py STEM) and GPU_REFERENCE_ENVIRONMENT (a JSON file taken as the
# machine's description, environment.json, instead of describing it with torch: a stubbed run imports no torch).
set -uo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$ROOT" || exit 2
STARTED=$(date +%s)

DRY_RUN=${GPU_REFERENCE_DRY_RUN:-0}
BARE=0
MODE=run
UNPACK_FROM=""
NOTEBOOKS=()
while [ $# -gt 0 ]; do
    case "$1" in
        --dry-run) DRY_RUN=1 ;;
        --plan) MODE=plan ;;
        --wheels) MODE=wheels ;;
        --bare) BARE=1 ;;
        --unpack) MODE=unpack; UNPACK_FROM=${2:-}; shift ;;
        --no-tests) GPU_REFERENCE_PYTEST_ARGS=""; GPU_REFERENCE_CALCULATOR_ARGS="" ;;
        -h|--help) sed -n '2,/^set -uo/p' "$0" | sed '$d; s/^# \{0,1\}//'; exit 0 ;;
        -*) echo "unknown option $1 (expected --dry-run, --plan, --no-tests, --wheels, --unpack DIR or NN[:check|:full])" >&2
            exit 2 ;;
        *) NOTEBOOKS+=("$1") ;;
    esac
    shift
done

RESULTS=${GPU_REFERENCE_RESULTS:-$ROOT/results}          # results/<device>/ folders: copied from, unpacked into
RUNS=${GPU_REFERENCE_RUNS:-$ROOT/build/gpu-reference-runs}  # --unpack puts each device's whole run here
PART_MIB=${GPU_REFERENCE_PART_MIB:-15}                     # executed.tar.gz is split into parts of this size
RETURN_FILES=8                                             # what a device call brings back from $OUT: 8 files,
RETURN_LIMIT_MIB=${GPU_REFERENCE_RETURN_MIB:-64}           # 64 MiB in all

# what the GPU image already has (KINDS.md's package list, 2026-11-17): --wheels leaves these out, except the
# packages named here that requirements.txt pins
IMAGE_HAS="numpy pillow fonttools kiwisolver contourpy cycler pyparsing python_dateutil six packaging pygments pyyaml
psutil requests urllib3 certifi idna charset_normalizer jinja2 markupsafe attrs typing_extensions tqdm click"
WHEEL_PACKAGES="papermill nbclient nbformat nbconvert ipykernel matplotlib"

if [ "$MODE" = wheels ]; then
    PY=${PYTHON:-$ROOT/.venv/bin/python}
    pins=()
    for name in $WHEEL_PACKAGES; do
        pin=$(grep -E "^$name==" requirements.txt) || { echo "requirements.txt pins no $name" >&2; exit 2; }
        pins+=("$pin")
    done
    rm -rf .whl && mkdir .whl || exit 2
    platform=(--only-binary=:all: --python-version 3.12 --implementation cp --platform manylinux_2_28_x86_64
              --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64)
    "$PY" -m pip download --quiet "${platform[@]}" -d .whl "${pins[@]}" || { echo "pip download failed" >&2; exit 2; }
    if [ "$BARE" = 1 ]; then
        # transformers with its dependencies; peft and accelerate without theirs (they require torch, which the
        # image has: pip would fetch a CUDA torch of several GB), then their other dependencies
        hf_pins=()
        for name in transformers peft; do hf_pins+=("$(grep -E "^$name==" requirements.txt)"); done
        "$PY" -m pip download --quiet "${platform[@]}" -d .whl "${hf_pins[0]}" psutil pyyaml safetensors || exit 2
        "$PY" -m pip download --quiet "${platform[@]}" --no-deps -d .whl "${hf_pins[1]}" accelerate || exit 2
        # pip evaluated the wheels' markers for this Python, not the image's 3.12 (papermill needs aiohttp on 3.12
        # only), and pytest (the CUDA unit tests) is nobody's dependency: fetch what a Python 3.12 image with torch
        # alone would still lack, following the wheels' metadata, until nothing is missing
        for round in 1 2 3 4 5 6; do
            missing=$("$PY" tools/gpu_install.py --wheels .whl --python 3.12 --bare --missing) || exit 2
            [ -z "$missing" ] && break
            wanted=()
            for name in $missing; do
                wanted+=("$(grep -iE "^${name//-/[-_]}==" requirements.txt || echo "$name")")
            done
            "$PY" -m pip download --quiet "${platform[@]}" --no-deps -d .whl "${wanted[@]}" || exit 2
        done
        [ -n "$missing" ] && { echo "still missing for Python 3.12: $missing" >&2; exit 2; }
        # what even a bare image must hold for the rest to fit a call (tools/gpu_install.py's BARE_IMAGE_HAS)
        must_have=$("$PY" -c "from tools.gpu_install import BARE_IMAGE_HAS as b; print(' '.join(sorted(b)))") || exit 2
        for wheel in .whl/*.whl; do
            name=$(basename "$wheel" | cut -d- -f1 | tr 'A-Z_' 'a-z-')
            for provided in $must_have; do [ "$name" = "$provided" ] && rm -f "$wheel"; done
        done
        echo "the image must hold Python 3.12, torch and: $must_have"
    else
        # the image has transformers and peft, but the calculator's replay is validated against the pinned versions:
        # carried without their dependencies (the image's serve), installed over the image's (tools/gpu_install.py)
        for name in transformers peft; do
            "$PY" -m pip download --quiet "${platform[@]}" --no-deps -d .whl "$(grep -E "^$name==" requirements.txt)" \
                || exit 2
        done
        for wheel in .whl/*.whl; do
            name=$(basename "$wheel" | cut -d- -f1 | tr 'A-Z-' 'a-z_')
            for provided in $IMAGE_HAS; do
                [ "$name" = "$provided" ] && rm -f "$wheel"
            done
        done
    fi
    size_mib=$(( $(du -sk .whl | cut -f1) / 1024 ))
    [ "$size_mib" -gt 56 ] && echo "warning: .whl/ is ${size_mib} MiB: with the tree it may pass the 64 MiB a call carries" >&2
    if [ "$BARE" = 1 ]; then
        echo "$(ls .whl/*.whl | wc -l) wheels in .whl/, $(du -sh .whl | cut -f1) (for an image with Python 3.12 and torch)"
    else
        echo "$(ls .whl/*.whl | wc -l) wheels in .whl/, $(du -sh .whl | cut -f1) (the GPU image's own packages left out:"
        echo "  $(echo $IMAGE_HAS))"
    fi
    echo "a device call carries them with carry=[\".whl\"]; tools/gpu_reference.sh installs them there"
    exit 0
fi

if [ "$MODE" = unpack ]; then
    [ -n "$UNPACK_FROM" ] && [ -f "$UNPACK_FROM/reference.tar.gz" ] || {
        echo "--unpack DIR: expected DIR to hold reference.tar.gz (what a run left in \$OUT)" >&2; exit 2; }
    PY=${PYTHON:-$ROOT/.venv/bin/python}
    work=$(mktemp -d) || exit 2
    tar -xzf "$UNPACK_FROM/reference.tar.gz" -C "$work" || exit 5
    slug=$("$PY" -c "import json,sys; print(json.load(open(sys.argv[1]))['slug'])" "$work/environment.json") || exit 5
    case "$slug" in ''|*[!a-z0-9-]*) echo "unexpected device slug '$slug' in the pack" >&2; exit 5 ;; esac
    target="$RUNS/$slug"
    rm -rf "$target" && mkdir -p "$target" && cp -r "$work"/. "$target"/ || exit 5
    if ls "$UNPACK_FROM"/executed.tar.gz* >/dev/null 2>&1; then
        cat $(ls "$UNPACK_FROM"/executed.tar.gz* | sort) | tar -xzf - -C "$target" || exit 5
    fi
    if [ -d "$work/filed/$slug" ]; then
        # the pack's figures and records are added to what results/<slug>/ holds: a run filed from a checkout that
        # lacked an earlier call's results (two calls before either was unpacked) does not erase that call's
        mkdir -p "$RESULTS/$slug" || exit 5
        "$PY" tools/gpu_reference_merge.py "$work/filed/$slug" "$RESULTS/$slug" || exit 5
        echo "filed: $RESULTS/$slug/ ($(find "$RESULTS/$slug" -type f | wc -l) files); regenerate the README's"
        echo "       measured section with: .venv/bin/python tools/readme_results.py"
    else
        echo "nothing was filed on the device (the summary's 'filed' line says why): results/ unchanged"
    fi
    echo "the whole run (executed notebooks, logs, summary): $target/"
    rm -rf "$work"
    cat "$target/summary.txt"
    exit 0
fi

# --- a run --------------------------------------------------------------------------------------------------
# the requests are checked before anything is made: NN, a stem, NN:check or NN:full (tools/gpu_plan.py)
PLAN_PY=${PYTHON:-python3}
[ "$DRY_RUN" = 1 ] && [ -z "${PYTHON:-}" ] && PLAN_PY=$ROOT/.venv/bin/python
PLAN_FLAGS=()
[ "$DRY_RUN" = 1 ] && PLAN_FLAGS+=(--dry-run)
"$PLAN_PY" tools/gpu_plan.py --budget 1 "${PLAN_FLAGS[@]}" "${NOTEBOOKS[@]}" > /dev/null || exit 2

# one call's command time, and what each call spends outside its notebooks: tools/gpu_plan.py holds the numbers
# (three calls on one warm machine and its start fit a session's 15 minutes of device time)
read -r DEFAULT_BUDGET_S SETUP_ESTIMATE_S PACK_RESERVE_S < <("$PLAN_PY" -c \
    "from tools.gpu_plan import CALL_BUDGET_S as c, SETUP_S as s, PACK_RESERVE_S as p; print(c, s, p)") || exit 2
BUDGET_S=${GPU_REFERENCE_BUDGET_S:-$DEFAULT_BUDGET_S}
NOTEBOOK_TIMEOUT_S=${GPU_REFERENCE_NOTEBOOK_TIMEOUT_S:-330}
TESTS_TIMEOUT_S=${GPU_REFERENCE_TESTS_TIMEOUT_S:-45}
PYTEST_ARGS=${GPU_REFERENCE_PYTEST_ARGS-tests/test_cuda_paths.py tests/test_memory.py tests/test_env.py \
tests/test_timing_grads_models.py tests/test_gpu_sizes.py}
CHECK_JOBS=${GPU_REFERENCE_CHECK_JOBS:-4}   # check-mode notebooks at a time (a dry run, on this machine: 1)
[ "$DRY_RUN" = 1 ] && CHECK_JOBS=${GPU_REFERENCE_CHECK_JOBS:-1}
case $CHECK_JOBS in ''|*[!0-9]*|0) echo "GPU_REFERENCE_CHECK_JOBS must be a positive whole number, got '$CHECK_JOBS'" >&2
    exit 2 ;; esac
PLAN_FLAGS+=(--check-jobs "$CHECK_JOBS")
MIN_NOTEBOOK_S=10          # a notebook with less time left than this (or than its estimate) is not started
if [ "$MODE" = plan ]; then   # a plan alone: what a call would run, with estimates, for the GPU named by its slug
    record=${GPU_REFERENCE_SLUG:+$RESULTS/$GPU_REFERENCE_SLUG/reference_run.json}
    "$PLAN_PY" tools/gpu_plan.py --print --calls 3 "${PLAN_FLAGS[@]}" \
        --budget $(( BUDGET_S - SETUP_ESTIMATE_S - PACK_RESERVE_S )) ${GPU_REFERENCE_SLUG:+--slug "$GPU_REFERENCE_SLUG"} \
        ${record:+--record "$record"} "${NOTEBOOKS[@]}" || exit 2
    echo "(each call: $BUDGET_S s of command time, the first $SETUP_ESTIMATE_S s installing, the last $PACK_RESERVE_S s" \
         "filing and packing; GPU_REFERENCE_SLUG=<results folder> plans around what that GPU already passed)"
    exit 0
fi
if [ "$DRY_RUN" = 1 ]; then
    CALCULATOR_ARGS=${GPU_REFERENCE_CALCULATOR_ARGS---validate --check --on cpu}
    PY=${PYTHON:-$ROOT/.venv/bin/python}
    BUILD=${GPU_REFERENCE_BUILD:-$ROOT/build/gpu-reference-dry}
    export PYTORCH_INTRO_CHECK_MODE=1
else
    CALCULATOR_ARGS=${GPU_REFERENCE_CALCULATOR_ARGS---validate --on cuda}
    PY=${PYTHON:-python3}
    BUILD=${GPU_REFERENCE_BUILD:-$ROOT/build/gpu-reference}
    export PYTORCH_INTRO_CHECK_MODE=0
fi
OUT_DIR=${OUT:-$BUILD-out}
RUN=$BUILD/run
FAILED_AT=""
mkdir -p "$OUT_DIR" && rm -f "$OUT_DIR/summary.txt" "$OUT_DIR"/reference.tar.gz "$OUT_DIR"/executed.tar.gz*
on_exit() {   # summary.txt on every exit: an early one says where the run stopped, and packs the logs it has
    local rc=$?
    [ -s "$OUT_DIR/summary.txt" ] && return
    {
        echo "GPU reference run stopped early (exit $rc): ${FAILED_AT:-before any notebook ran; see logs/}"
        [ -s "$BUILD/status.tsv" ] && { echo "notebooks run before the stop:"; cat "$BUILD/status.tsv"; }
        [ -f "$BUILD/logs/install-missing.txt" ] && cat "$BUILD/logs/install-missing.txt"
    } > "$OUT_DIR/summary.txt" 2>/dev/null
    [ -d "$BUILD/logs" ] && tar -czf "$OUT_DIR/reference.tar.gz" -C "$BUILD" logs 2>/dev/null
    cat "$OUT_DIR/summary.txt" 2>/dev/null
}
trap on_exit EXIT
mkdir -p "$BUILD" || exit 2
if [ -n "$(ls -A "$BUILD")" ] && [ ! -f "$BUILD/.gpu-reference" ]; then
    echo "$BUILD holds files this script did not make: expected an empty or earlier gpu_reference folder" >&2
    exit 2
fi
rm -rf "$BUILD" && mkdir -p "$BUILD/logs" "$RUN" "$OUT_DIR" && touch "$BUILD/.gpu-reference" || exit 2
export PYTORCH_INTRO_BUILD_DIR=$RUN PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1
STATUS=$BUILD/status.tsv
: > "$STATUS"
infra=0

if [ "$DRY_RUN" != 1 ]; then
    WHEELS=${GPU_REFERENCE_WHEELS:-$ROOT/.whl}
    if ! ls "$WHEELS"/*.whl > /dev/null 2>&1; then
        echo "no wheels in $WHEELS: run \`make gpu-wheels\` where pip reaches PyPI, and carry .whl with the call" >&2
        exit 2
    fi
    SITE=${GPU_REFERENCE_SITE:-/tmp/pytorch-intro-site}
    # only what the image lacks: tools/gpu_install.py follows the requirements through the wheels' metadata and
    # leaves out every distribution the image already has (a bare image with torch alone gets everything carried)
    "$PY" tools/gpu_install.py --wheels "$WHEELS" > "$BUILD/logs/install-plan.txt" 2> "$BUILD/logs/install-missing.txt"
    plan_rc=$?
    if [ "$plan_rc" -ne 0 ]; then
        FAILED_AT="install: $(tail -1 "$BUILD/logs/install-missing.txt")"; cat "$BUILD/logs/install-missing.txt" >&2
        exit 2
    fi
    if [ -s "$BUILD/logs/install-plan.txt" ]; then
        # shellcheck disable=SC2046
        "$PY" -m pip install --quiet --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" \
            $(cat "$BUILD/logs/install-plan.txt") > "$BUILD/logs/pip.log" 2>&1 || {
            FAILED_AT="install: pip failed"; cat "$BUILD/logs/pip.log" >&2; echo "installing the wheels failed" >&2; exit 2; }
    fi
    echo "installed from .whl: $(wc -l < "$BUILD/logs/install-plan.txt") wheels (the image has the rest)"
    # the packages, and their data files (nbconvert's HTML templates) where Jupyter looks for them
    export PYTHONPATH="$ROOT:$SITE${PYTHONPATH:+:$PYTHONPATH}"
    export JUPYTER_PATH="$SITE/share/jupyter${JUPYTER_PATH:+:$JUPYTER_PATH}"
    "$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" || {
        echo "torch.cuda.is_available() is False here: a reference run needs a GPU (--dry-run runs on a CPU)" >&2
        exit 3; }
else
    export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
fi

# the environment: GPU, driver, CUDA, torch (nvidia-smi's own report goes into the pack too)
nvidia-smi > "$BUILD/nvidia-smi.txt" 2>&1 || echo "no nvidia-smi here" > "$BUILD/nvidia-smi.txt"
if [ -n "${GPU_REFERENCE_ENVIRONMENT:-}" ]; then   # tests only: a described machine, without importing torch
    cp "$GPU_REFERENCE_ENVIRONMENT" "$BUILD/environment.json" > "$BUILD/logs/environment.log" 2>&1
else
    "$PY" - "$BUILD/environment.json" "$DRY_RUN" > "$BUILD/logs/environment.log" 2>&1 <<'PY'
import json, platform, subprocess, sys
import torch
from tools.devices import describe_device

path, dry_run = sys.argv[1], sys.argv[2] == "1"
environment = describe_device()
environment.update(python=platform.python_version(), platform=platform.platform(), dry_run=dry_run,
                   torch_cuda=torch.version.cuda,
                   cudnn=torch.backends.cudnn.version() if torch.cuda.is_available() else None)
if torch.cuda.is_available():
    properties = torch.cuda.get_device_properties(0)
    environment.update(gpu_count=torch.cuda.device_count(), capability=list(torch.cuda.get_device_capability(0)),
                       total_memory_bytes=properties.total_memory, multiprocessors=properties.multi_processor_count)
try:
    query = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version,memory.total", "--format=csv,noheader"],
                           capture_output=True, text=True, timeout=30)
    environment["nvidia_smi"] = query.stdout.strip().splitlines() if query.returncode == 0 else None
except (OSError, subprocess.SubprocessError):
    environment["nvidia_smi"] = None
with open(path, "w") as f:
    json.dump(environment, f, indent=2)
print(environment["name"])
PY
fi
[ -f "$BUILD/environment.json" ] || {
    cat "$BUILD/logs/environment.log" >&2; echo "describing the machine failed" >&2; exit 2; }
SLUG=$("$PY" -c "import json,sys; print(json.load(open(sys.argv[1]))['slug'])" "$BUILD/environment.json") || exit 2

summarize() {   # status.tsv, the executed notebooks and the environment -> status.json and summary.txt
    "$PY" - "$BUILD" "$OUT_DIR" "$BUDGET_S" <<'PY'
import json, sys, time
from pathlib import Path

build, out, budget = Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3]
environment = json.loads((build / "environment.json").read_text())


def first_error(stem: str, mode: str) -> str:
    """The failing cell and its error, from the executed copy (papermill keeps it up to the failure)."""
    path = build / "run" / ("check" if mode == "check" else "") / "executed" / f"{stem}.ipynb"
    if not path.exists():
        log = build / "logs" / f"{stem}-{mode}.log"
        text = log.read_text(errors="replace") if log.exists() else ""
        last = [line.strip() for line in text.splitlines() if line.strip()]
        return f"no executed copy; log: {last[-1]}" if last else "no executed copy, empty log"
    cells = json.loads(path.read_text()).get("cells", [])
    for index, cell in enumerate(cells):
        for output in cell.get("outputs", []):
            if output.get("output_type") == "error" and output.get("ename") != "PapermillExecutionError":
                evalue = (str(output.get("evalue") or "").splitlines() or [""])[0]
                return f"cell {index}: {output.get('ename')}: {evalue}"
    ran = [i for i, c in enumerate(cells) if c.get("cell_type") == "code" and c.get("execution_count")]
    return f"last cell run: {ran[-1]}" if ran else "no cell ran"


rows = []
for line in (build / "status.tsv").read_text().splitlines():
    stem, mode, status, seconds, rc = line.split("\t")
    detail = {"ok": "", "not run": "left for a later call"}.get(status)
    if detail is None:
        detail = first_error(stem, mode)
    rows.append({"notebook": stem, "mode": mode, "status": status, "seconds": float(seconds), "exit_code": int(rc),
                 "detail": detail})
tests = json.loads((build / "tests.json").read_text()) if (build / "tests.json").exists() else None
filed = json.loads((build / "filed.json").read_text()) if (build / "filed.json").exists() else None
status = {"environment": environment, "notebooks": rows, "unit_tests": tests, "filed": filed,
          "mode": "check (dry run)" if environment.get("dry_run") else "check, then full", "budget_s": float(budget)}
(build / "status.json").write_text(json.dumps(status, indent=2) + "\n")

smi = environment.get("nvidia_smi") or []
driver = f"driver {smi[0].split(',')[1].strip()}" if smi and smi[0].count(",") >= 2 else "no NVIDIA driver"
lines = [f"GPU reference run: {environment['name']} | {driver} | CUDA {environment.get('torch_cuda')} | "
         f"torch {environment['torch']} | {status['mode']} mode",
         f"unit tests: {tests['status']} ({tests['line']})" if tests else "unit tests: not run",
         "", f"{'notebook':<42}{'mode':<6}{'status':<9}{'seconds':>8}  first error / note"]
for row in rows:
    lines.append(f"{row['notebook']:<42}{row['mode']:<6}{row['status']:<9}{row['seconds']:>8.1f}  {row['detail'][:64]}")
counts = {s: sum(r["status"] == s for r in rows) for s in ("ok", "FAILED", "TIMEOUT", "CRASHED", "not run")}
lines += ["", "  ".join(f"{n} {s}" for s, n in counts.items() if n)]
if filed:
    lines.append(f"filed: {filed['note']}")
lines.append("unpack where the tools are: tools/gpu_reference.sh --unpack <the folder holding reference.tar.gz>")
(build / "summary.txt").write_text("\n".join(lines) + "\n")
PY
}

pack() {   # summary, results, logs, the filed folder -> $OUT/reference.tar.gz; executed notebooks -> executed.tar.gz
    summarize || return 1
    cp "$BUILD/summary.txt" "$OUT_DIR/summary.txt" || return 1
    local members=(summary.txt status.json environment.json nvidia-smi.txt logs)
    for extra in filed plan.txt run/runtimes.json run/results run/results.json run/figures tests.log \
                 calculator_validation.txt; do
        [ -e "$BUILD/$extra" ] && members+=("$extra")
    done
    for extra in "$RUN"/check/runtimes-*.json; do [ -e "$extra" ] && members+=("run/check/${extra##*/}"); done
    tar -czf "$OUT_DIR/reference.tar.gz" -C "$BUILD" "${members[@]}" || return 1
    rm -f "$OUT_DIR"/executed.tar.gz*
    # what a device call returns: at most 8 files, 16 MiB each, 64 MiB in all (the device tool's limits). The
    # executed notebooks go in parts into what summary.txt and reference.tar.gz leave; when they do not fit, check
    # mode's copies are dropped first (full mode's hold the figures' outputs), then all of them, and summary.txt says so
    local room parts_allowed executed=() size
    room=$(( RETURN_LIMIT_MIB * 1024 * 1024 - $(stat -c %s "$OUT_DIR/reference.tar.gz") \
             - $(stat -c %s "$OUT_DIR/summary.txt") - 1024 * 1024 ))
    parts_allowed=$(( RETURN_FILES - 2 ))
    [ -d "$RUN/executed" ] && executed+=(run/executed)
    [ -d "$RUN/check/executed" ] && executed+=(run/check/executed)
    while [ ${#executed[@]} -gt 0 ]; do
        tar -czf "$OUT_DIR/executed.tar.gz" -C "$BUILD" "${executed[@]}" || return 1
        size=$(stat -c %s "$OUT_DIR/executed.tar.gz")
        if [ "$size" -le "$room" ] && [ "$size" -le $(( parts_allowed * PART_MIB * 1024 * 1024 )) ]; then
            if [ "$size" -gt $((PART_MIB * 1024 * 1024)) ]; then
                split -b "${PART_MIB}M" -d -a 1 "$OUT_DIR/executed.tar.gz" "$OUT_DIR/executed.tar.gz.part-" \
                    && rm -f "$OUT_DIR/executed.tar.gz" || return 1
            fi
            break
        fi
        rm -f "$OUT_DIR/executed.tar.gz"
        echo "executed notebooks left out of the pack: ${executed[-1]} ($((size / 1024 / 1024)) MiB compressed with" \
             "the rest; a call returns $RETURN_FILES files, $RETURN_LIMIT_MIB MiB in all)" >> "$OUT_DIR/summary.txt"
        unset 'executed[-1]'
    done
}

kernels_of() {   # the processes whose command line names this notebook's own runtime folder: its kernel
    local file args
    for file in /proc/[0-9]*/cmdline; do
        mapfile -d '' args < "$file" 2>/dev/null || continue
        [[ " ${args[*]} " == *" $1/"* ]] && { file=${file#/proc/}; echo "${file%/cmdline}"; }
    done
}

kill_kernels() {   # a notebook killed at its time limit leaves its kernel (started in a session of its own) behind
    local runtime=$1 pid tries=0
    for pid in $(kernels_of "$runtime"); do
        kill -TERM -- "-$pid" 2>/dev/null || kill -TERM "$pid" 2>/dev/null
    done
    while [ -n "$(kernels_of "$runtime")" ] && [ $tries -lt 30 ]; do
        sleep 0.1; tries=$((tries + 1))
    done
    for pid in $(kernels_of "$runtime"); do
        kill -KILL -- "-$pid" 2>/dev/null || kill -KILL "$pid" 2>/dev/null
    done
}

# the unit tests that run CUDA branches (on a GPU their needs_cuda tests run too), and the memory calculator's
# validation grid against the allocator (issue 24): in the background, beside the check-mode notebooks (a GPU machine
# has 16 cores; each process has its own CUDA context and allocator statistics), waited for before full mode
setup_checks() {
    if [ -n "$PYTEST_ARGS" ]; then
        local began rc took last verdict
        began=$(date +%s)
        # shellcheck disable=SC2086
        timeout --kill-after=10 "$TESTS_TIMEOUT_S" "$PY" -m pytest -q -p no:cacheprovider -p no:nbval $PYTEST_ARGS \
            > "$BUILD/tests.log" 2>&1
        rc=$?
        took=$(( $(date +%s) - began ))
        last=$(grep -E "(passed|failed|error|no tests ran)" "$BUILD/tests.log" | tail -1 | sed 's/=//g; s/^ *//; s/ *$//')
        case $rc in
            0) verdict=passed ;;
            124|137) verdict="timed out after ${TESTS_TIMEOUT_S} s" ;;
            *) verdict="FAILED (exit $rc)" ;;
        esac
        "$PY" -c "import json, sys; json.dump(dict(status=sys.argv[1], line=sys.argv[2]), open(sys.argv[3], 'w'))" \
            "$verdict" "${last:-no summary line} in $took s" "$BUILD/tests.json"
    fi
    if [ -n "$CALCULATOR_ARGS" ]; then
        # shellcheck disable=SC2086
        timeout --kill-after=10 "$TESTS_TIMEOUT_S" "$PY" -m utils.calculator $CALCULATOR_ARGS \
            > "$BUILD/calculator_validation.txt" 2>&1 \
            || echo "python -m utils.calculator $CALCULATOR_ARGS: exit $?" >> "$BUILD/calculator_validation.txt"
    fi
}
BACKGROUND=()          # the unit tests and the check-mode notebooks running now (the plan's background steps)

drain() {   # wait for everything running in the background, then pack what it made
    local pid
    [ ${#BACKGROUND[@]} -eq 0 ] && return 0
    for pid in "${BACKGROUND[@]}"; do wait "$pid"; done
    BACKGROUND=()
    pack || { FAILED_AT="packing failed"; echo "packing failed" >&2; exit 5; }
}

run_step() {   # one notebook in one mode under its limit; appends its line to status.tsv
    local stem=$1 mode=$2 limit=$3 began rc seconds status runtime build_dir check runner executed
    began=$(date +%s)
    runtime="$BUILD/runtime/$stem-$mode"
    mkdir -p "$runtime"
    # each mode writes its own build folder: check mode's executed copies never replace full mode's; check-mode runs
    # go several at a time, each into a folder of its own (run_notebooks.py rewrites runtimes.json and results.json),
    # and their executed copies and wall times are moved together afterwards
    build_dir=$RUN
    check=0
    if [ "$mode" = check ]; then build_dir=$RUN/check-runs/$stem; check=1; fi
    runner=("$PY" tools/run_notebooks.py)
    # shellcheck disable=SC2206
    [ -n "${GPU_REFERENCE_RUNNER:-}" ] && runner=($GPU_REFERENCE_RUNNER)
    PYTORCH_INTRO_BUILD_DIR=$build_dir PYTORCH_INTRO_CHECK_MODE=$check JUPYTER_RUNTIME_DIR=$runtime \
        timeout --kill-after=15 "$limit" "${runner[@]}" "$stem" > "$BUILD/logs/$stem-$mode.log" 2>&1
    rc=$?
    seconds=$(( $(date +%s) - began ))
    if [ "$mode" = check ]; then
        mkdir -p "$RUN/check/executed"
        for executed in "$build_dir"/executed/*; do [ -e "$executed" ] && mv "$executed" "$RUN/check/executed/"; done
        [ -f "$build_dir/runtimes.json" ] && mv "$build_dir/runtimes.json" "$RUN/check/runtimes-$stem.json"
    fi
    case $rc in
        0) status=ok ;;
        1) status=FAILED ;;
        124|137) status=TIMEOUT; kill_kernels "$runtime" ;;
        *) status=CRASHED; : > "$BUILD/.runner-crashed" ;;
    esac
    printf '%s\t%s\t%s\t%s\t%s\n' "$stem" "$mode" "$status" "$seconds" "$rc" >> "$STATUS"
}

DEADLINE=$((STARTED + BUDGET_S))
# the plan for the time left (tools/gpu_plan.py): full mode for what was never filed on this GPU, then the unit tests
# and check mode for what changed since it passed, then re-measurements, less what already passed
# (results/<gpu>/reference_run.json); or what the arguments asked for, in their order
RECORD=$RESULTS/$SLUG/reference_run.json
left=$((DEADLINE - $(date +%s) - PACK_RESERVE_S))
"$PY" tools/gpu_plan.py --print --calls 3 "${PLAN_FLAGS[@]}" --budget "$(( left > 1 ? left : 1 ))" \
    --record "$RECORD" --slug "$SLUG" "${NOTEBOOKS[@]}" > "$BUILD/plan.txt" 2>&1
"$PY" tools/gpu_plan.py "${PLAN_FLAGS[@]}" --budget "$(( left > 1 ? left : 1 ))" --record "$RECORD" --slug "$SLUG" \
    "${NOTEBOOKS[@]}" > "$BUILD/plan.tsv" || { FAILED_AT="planning failed"; exit 2; }
cat "$BUILD/plan.txt"
while IFS=$'\t' read -r stem mode estimate planned_limit; do
    # full mode runs alone (its timings are reported): what runs in the background finishes first
    [ "$mode" = full ] && drain
    while [ "$mode" = check ] && [ ${#BACKGROUND[@]} -ge "$CHECK_JOBS" ]; do
        wait -n
        running=()
        for pid in "${BACKGROUND[@]}"; do kill -0 "$pid" 2>/dev/null && running+=("$pid"); done
        BACKGROUND=("${running[@]}")
    done
    now=$(date +%s)
    left=$((DEADLINE - now - PACK_RESERVE_S))
    if [ "$planned_limit" -eq 0 ] || [ "$left" -lt "$MIN_NOTEBOOK_S" ] || [ "$left" -lt "$estimate" ]; then
        printf '%s\t%s\tnot run\t0\t0\n' "$stem" "$mode" >> "$STATUS"
        continue
    fi
    limit=$planned_limit
    [ "$limit" -gt "$NOTEBOOK_TIMEOUT_S" ] && limit=$NOTEBOOK_TIMEOUT_S
    [ "$limit" -gt "$left" ] && limit=$left
    if [ "$stem" = unit-tests ]; then   # the plan's background step for the unit tests and the calculator's grid
        if [ -n "$PYTEST_ARGS$CALCULATOR_ARGS" ]; then
            echo "running the unit tests and the calculator grid (estimate ${estimate} s)"
            setup_checks &
            BACKGROUND+=($!)
        fi
        continue
    fi
    echo "running $stem in $mode mode (estimate ${estimate} s, limit ${limit} s)"
    if [ "$mode" = check ]; then
        run_step "$stem" "$mode" "$limit" &
        BACKGROUND+=($!)
    else
        run_step "$stem" "$mode" "$limit"
        pack || { FAILED_AT="packing failed after $stem"; echo "packing failed" >&2; exit 5; }
    fi
done < "$BUILD/plan.tsv"
drain
[ -f "$BUILD/.runner-crashed" ] && infra=4

# file the figures like `make results`, onto a copy of this device's results/ folder (what the unpack copies back)
mkdir -p "$BUILD/filed" || exit 5
[ -d "$RESULTS/$SLUG" ] && cp -r "$RESULTS/$SLUG" "$BUILD/filed/"
"$PY" - "$RUN" "$BUILD/filed" > "$BUILD/logs/filing.log" 2>&1 <<'PY'
import sys
from pathlib import Path
from tools.save_results import ResultsError, save   # what `make results` runs, less its check-mode times

try:
    print(f"filed under {save(Path(sys.argv[1]), Path(sys.argv[2]), check_build=None)}")
except ResultsError as error:
    sys.exit(f"error: {error}")
PY
"$PY" - "$BUILD" "$SLUG" "$?" <<'PY'
import json, shutil, sys
from pathlib import Path

build, slug, rc = Path(sys.argv[1]), sys.argv[2], int(sys.argv[3])
folder = build / "filed" / slug


def update_runs(record: dict, build: Path) -> None:
    """record["runs"][stem][mode] = this call's status, seconds, the notebook file's hash and its code hash (what the
    next call's default plan skips when it passed, and what the README compares a filed figure against,
    tools/gpu_plan.py); record["tests"] = the unit tests' verdict and the hash of what they test."""
    from tools.gpu_plan import code_hash, notebook_hash, unit_tests_hash
    runs = record.setdefault("runs", {})
    for line in (build / "status.tsv").read_text().splitlines():
        stem, mode, status, seconds, _ = line.split("\t")
        if status != "not run":
            runs.setdefault(stem, {})[mode] = {"status": status, "seconds": float(seconds),
                                               "hash": notebook_hash(stem), "code_hash": code_hash(stem)}
    if (build / "tests.json").exists():
        tests = json.loads((build / "tests.json").read_text())
        record["tests"] = {"status": "ok" if tests.get("status") == "passed" else tests.get("status"),
                           "line": tests.get("line"), "hash": unit_tests_hash()}

log = (build / "logs" / "filing.log").read_text().strip()
if rc == 0 and folder.is_dir():
    figures = sorted(p.name for p in (folder / "figures").glob("*.png"))
    note = f"results/{slug}/ ({len(figures)} figures, with what earlier runs filed there)"
    # the runs' own record beside the figures: how each notebook went, on which driver, CUDA and torch (a later
    # call that runs other notebooks adds to what an earlier call filed)
    record_path = folder / "reference_run.json"
    record = json.loads(record_path.read_text()) if record_path.exists() else {}
    record["environment"] = json.loads((build / "environment.json").read_text())
    update_runs(record, build)
    record_path.write_text(json.dumps(record, indent=2, sort_keys=True) + "\n")
elif json.loads((build / "environment.json").read_text()).get("dry_run"):
    note = "nothing: a dry run is in check mode, and results/ holds full-mode runs only"
    shutil.rmtree(build / "filed", ignore_errors=True)
else:
    # no figures to file (no full-mode notebook passed), but the record of what ran on this GPU still goes back, so
    # the next call's default plan skips the check-mode runs that passed
    folder.mkdir(parents=True, exist_ok=True)
    record_path = folder / "reference_run.json"
    record = json.loads(record_path.read_text()) if record_path.exists() else {}
    record["environment"] = json.loads((build / "environment.json").read_text())
    update_runs(record, build)
    record_path.write_text(json.dumps(record, indent=2, sort_keys=True) + "\n")
    note = (f"the run record only, results/{slug}/reference_run.json (no figures: "
            + (log.splitlines()[-1][:120] if log else f"save_results exited {rc}") + ")")
(build / "filed.json").write_text(json.dumps({"exit_code": rc, "note": note}) + "\n")
PY
pack || { echo "packing failed" >&2; exit 5; }

echo
cat "$OUT_DIR/summary.txt"
echo "in $OUT_DIR: $(cd "$OUT_DIR" && ls -1 | tr '\n' ' ')($(du -sh "$OUT_DIR" | cut -f1))"
exit "$infra"
