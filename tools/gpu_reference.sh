#!/usr/bin/env bash
# The GPU reference run in one call: on a CUDA machine that has Python and torch but no Jupyter.
#
#   tools/gpu_reference.sh [NN ...]            run the notebooks (all, or those named by number or stem) in full mode
#   tools/gpu_reference.sh --dry-run [NN ...]  the same on this machine: the local .venv, check mode, no install
#   tools/gpu_reference.sh --wheels            (here, with network) download the wheels into .whl/ (make gpu-wheels)
#   tools/gpu_reference.sh --unpack DIR        (here) file what a run packed into DIR under results/<device>/
#
# A run: installs the wheels carried in .whl/ (papermill, nbclient, nbformat, nbconvert, ipykernel, matplotlib and
# what they need that the GPU image lacks) into a folder of their own; writes the environment (GPU, driver, CUDA,
# torch); runs the unit tests that exercise CUDA paths; runs each notebook with tools/run_notebooks.py under a
# per-notebook time limit and a total budget (a device call lasts at most 10 minutes); files the figures with
# tools/save_results.py (like `make results`, onto a copy of results/); and packs everything into $OUT (at most
# 8 files: summary.txt, reference.tar.gz, and the executed notebooks in executed.tar.gz or its parts), repacking
# after every notebook so a run cut short still returns what it did. It prints a one-screen summary and exits
# non-zero only for an infrastructure failure (2: setup or usage, 3: no GPU, 4: the runner itself crashed,
# 5: packing failed), never because a notebook failed or ran out of time: the summary says that.
#
# Variables: OUT (where the pack goes; default build/gpu-reference-out, or build/gpu-reference-dry-out),
# GPU_REFERENCE_BUDGET_S (total seconds, default 540), GPU_REFERENCE_NOTEBOOK_TIMEOUT_S (per notebook, default 300),
# GPU_REFERENCE_TESTS_TIMEOUT_S (default 120), GPU_REFERENCE_PYTEST_ARGS (the unit tests; empty or --no-tests: none),
# GPU_REFERENCE_CALCULATOR_ARGS (the memory calculator's grid measured on this device, `python -m utils.calculator
# ARGS`; default --validate --on cuda, in a dry run --validate --check --on cpu; empty or --no-tests: none),
# GPU_REFERENCE_DRY_RUN=1 (= --dry-run), PYTHON (the interpreter), GPU_REFERENCE_BUILD (the work folder),
# GPU_REFERENCE_WHEELS (default .whl/), GPU_REFERENCE_RESULTS (the results/ folder filed onto and unpacked into),
# GPU_REFERENCE_RUNS (where --unpack puts whole runs, default build/gpu-reference-runs), GPU_REFERENCE_PART_MIB
# (size of executed.tar.gz's parts, 15), and, for tests only, GPU_REFERENCE_RUNNER (a command run as
# `RUNNER STEM` instead of tools/run_notebooks.py STEM).
set -uo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$ROOT" || exit 2
STARTED=$(date +%s)

DRY_RUN=${GPU_REFERENCE_DRY_RUN:-0}
MODE=run
UNPACK_FROM=""
NOTEBOOKS=()
while [ $# -gt 0 ]; do
    case "$1" in
        --dry-run) DRY_RUN=1 ;;
        --wheels) MODE=wheels ;;
        --unpack) MODE=unpack; UNPACK_FROM=${2:-}; shift ;;
        --no-tests) GPU_REFERENCE_PYTEST_ARGS=""; GPU_REFERENCE_CALCULATOR_ARGS="" ;;
        -h|--help) sed -n '2,/^set -uo/p' "$0" | sed '$d; s/^# \{0,1\}//'; exit 0 ;;
        -*) echo "unknown option $1 (expected --dry-run, --no-tests, --wheels, --unpack DIR or notebook numbers)" >&2
            exit 2 ;;
        *) NOTEBOOKS+=("$1") ;;
    esac
    shift
done

RESULTS=${GPU_REFERENCE_RESULTS:-$ROOT/results}          # results/<device>/ folders: copied from, unpacked into
RUNS=${GPU_REFERENCE_RUNS:-$ROOT/build/gpu-reference-runs}  # --unpack puts each device's whole run here
PART_MIB=${GPU_REFERENCE_PART_MIB:-15}                     # executed.tar.gz is split into parts of this size

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
    "$PY" -m pip download --quiet --only-binary=:all: --python-version 3.12 --implementation cp \
        --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
        -d .whl "${pins[@]}" || { echo "pip download failed" >&2; exit 2; }
    for wheel in .whl/*.whl; do
        name=$(basename "$wheel" | cut -d- -f1 | tr 'A-Z-' 'a-z_')
        for provided in $IMAGE_HAS; do
            [ "$name" = "$provided" ] && rm -f "$wheel"
        done
    done
    echo "$(ls .whl/*.whl | wc -l) wheels in .whl/, $(du -sh .whl | cut -f1) (the GPU image's own packages left out:"
    echo "  $(echo $IMAGE_HAS))"
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
        mkdir -p "$RESULTS/$slug" && cp -r "$work/filed/$slug"/. "$RESULTS/$slug"/ || exit 5
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
# which notebooks, in course order (numbers or stems, as `make run` takes them)
ALL_STEMS=$(cd notebooks && ls [0-9][0-9]_*.ipynb | sed 's/\.ipynb$//')
STEMS=""
for stem in $ALL_STEMS; do
    wanted=$([ ${#NOTEBOOKS[@]} -eq 0 ] && echo yes)
    for name in "${NOTEBOOKS[@]}"; do
        [ "$name" = "$stem" ] || [ "$name" = "${stem:0:2}" ] && wanted=yes
    done
    [ -n "$wanted" ] && STEMS="$STEMS $stem"
done
for name in "${NOTEBOOKS[@]}"; do
    echo "$ALL_STEMS" | grep -qx -e "$name" -e "${name}_.*" || {
        echo "no notebook matches '$name'; the notebooks are: $(echo $ALL_STEMS)" >&2; exit 2; }
done

BUDGET_S=${GPU_REFERENCE_BUDGET_S:-540}
NOTEBOOK_TIMEOUT_S=${GPU_REFERENCE_NOTEBOOK_TIMEOUT_S:-300}
TESTS_TIMEOUT_S=${GPU_REFERENCE_TESTS_TIMEOUT_S:-120}
PYTEST_ARGS=${GPU_REFERENCE_PYTEST_ARGS-tests/test_cuda_paths.py tests/test_memory.py tests/test_env.py \
tests/test_timing_grads_models.py tests/test_gpu_sizes.py}
PACK_RESERVE_S=25          # kept back from the budget for filing and packing
MIN_NOTEBOOK_S=30          # a notebook with less time left than this is not started
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
mkdir -p "$BUILD" || exit 2
if [ -n "$(ls -A "$BUILD")" ] && [ ! -f "$BUILD/.gpu-reference" ]; then
    echo "$BUILD holds files this script did not make: expected an empty or earlier gpu_reference folder" >&2
    exit 2
fi
rm -rf "$BUILD" && mkdir -p "$BUILD/logs" "$RUN" "$OUT_DIR" && touch "$BUILD/.gpu-reference" || exit 2
rm -f "$OUT_DIR/summary.txt" "$OUT_DIR"/reference.tar.gz "$OUT_DIR"/executed.tar.gz*
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
    "$PY" -m pip install --quiet --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" \
        "$WHEELS"/*.whl > "$BUILD/logs/pip.log" 2>&1 || {
        cat "$BUILD/logs/pip.log" >&2; echo "installing the wheels failed" >&2; exit 2; }
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
[ -f "$BUILD/environment.json" ] || {
    cat "$BUILD/logs/environment.log" >&2; echo "describing the machine failed" >&2; exit 2; }
SLUG=$("$PY" -c "import json,sys; print(json.load(open(sys.argv[1]))['slug'])" "$BUILD/environment.json") || exit 2

summarize() {   # status.tsv, the executed notebooks and the environment -> status.json and summary.txt
    "$PY" - "$BUILD" "$OUT_DIR" "$BUDGET_S" <<'PY'
import json, sys, time
from pathlib import Path

build, out, budget = Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3]
environment = json.loads((build / "environment.json").read_text())


def first_error(stem: str) -> str:
    """The failing cell and its error, from the executed copy (papermill keeps it up to the failure)."""
    path = build / "run" / "executed" / f"{stem}.ipynb"
    if not path.exists():
        log = build / "logs" / f"{stem}.log"
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
    stem, status, seconds, rc = line.split("\t")
    detail = {"ok": "", "not run": "out of time"}.get(status)
    if detail is None:
        detail = first_error(stem)
    rows.append({"notebook": stem, "status": status, "seconds": float(seconds), "exit_code": int(rc),
                 "detail": detail})
tests = json.loads((build / "tests.json").read_text()) if (build / "tests.json").exists() else None
filed = json.loads((build / "filed.json").read_text()) if (build / "filed.json").exists() else None
status = {"environment": environment, "notebooks": rows, "unit_tests": tests, "filed": filed,
          "mode": "check (dry run)" if environment.get("dry_run") else "full", "budget_s": float(budget)}
(build / "status.json").write_text(json.dumps(status, indent=2) + "\n")

smi = environment.get("nvidia_smi") or []
driver = f"driver {smi[0].split(',')[1].strip()}" if smi and smi[0].count(",") >= 2 else "no NVIDIA driver"
lines = [f"GPU reference run: {environment['name']} | {driver} | CUDA {environment.get('torch_cuda')} | "
         f"torch {environment['torch']} | {status['mode']} mode",
         f"unit tests: {tests['status']} ({tests['line']})" if tests else "unit tests: not run",
         "", f"{'notebook':<44}{'status':<10}{'seconds':>8}  first error / note"]
for row in rows:
    lines.append(f"{row['notebook']:<44}{row['status']:<10}{row['seconds']:>8.1f}  {row['detail'][:70]}")
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
    for extra in filed run/runtimes.json run/results run/results.json run/figures tests.log calculator_validation.txt; do
        [ -e "$BUILD/$extra" ] && members+=("$extra")
    done
    tar -czf "$OUT_DIR/reference.tar.gz" -C "$BUILD" "${members[@]}" || return 1
    rm -f "$OUT_DIR"/executed.tar.gz*
    if [ -d "$RUN/executed" ]; then
        tar -czf "$OUT_DIR/executed.tar.gz" -C "$BUILD" run/executed || return 1
        local size
        size=$(stat -c %s "$OUT_DIR/executed.tar.gz")
        if [ "$size" -gt $((5 * PART_MIB * 1024 * 1024)) ]; then
            rm -f "$OUT_DIR/executed.tar.gz"   # more than five parts: the 8 files a device call returns would not do
            echo "executed notebooks left out of the pack: $((size / 1024 / 1024)) MiB compressed" \
                >> "$OUT_DIR/summary.txt"
        elif [ "$size" -gt $((PART_MIB * 1024 * 1024)) ]; then
            split -b "${PART_MIB}M" -d -a 1 "$OUT_DIR/executed.tar.gz" "$OUT_DIR/executed.tar.gz.part-" \
                && rm -f "$OUT_DIR/executed.tar.gz" || return 1
        fi
    fi
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

# the unit tests that run CUDA branches (on a GPU their needs_cuda tests run too)
if [ -n "$PYTEST_ARGS" ]; then
    began=$(date +%s)
    # shellcheck disable=SC2086
    timeout --kill-after=10 "$TESTS_TIMEOUT_S" "$PY" -m pytest -q -p no:cacheprovider $PYTEST_ARGS \
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

# the memory calculator's validation grid on this device: its prediction against the allocator (issue 24)
if [ -n "$CALCULATOR_ARGS" ]; then
    # shellcheck disable=SC2086
    timeout --kill-after=10 "$TESTS_TIMEOUT_S" "$PY" -m utils.calculator $CALCULATOR_ARGS \
        > "$BUILD/calculator_validation.txt" 2>&1 \
        || echo "python -m utils.calculator $CALCULATOR_ARGS: exit $?" >> "$BUILD/calculator_validation.txt"
fi

DEADLINE=$((STARTED + BUDGET_S))
for stem in $STEMS; do
    now=$(date +%s)
    left=$((DEADLINE - now - PACK_RESERVE_S))
    if [ "$left" -lt "$MIN_NOTEBOOK_S" ]; then
        printf '%s\tnot run\t0\t0\n' "$stem" >> "$STATUS"
        continue
    fi
    limit=$(( left < NOTEBOOK_TIMEOUT_S ? left : NOTEBOOK_TIMEOUT_S ))
    runtime="$BUILD/runtime/$stem"
    mkdir -p "$runtime"
    echo "running $stem (limit ${limit} s)"
    runner=("$PY" tools/run_notebooks.py)
    # shellcheck disable=SC2206
    [ -n "${GPU_REFERENCE_RUNNER:-}" ] && runner=($GPU_REFERENCE_RUNNER)
    JUPYTER_RUNTIME_DIR=$runtime timeout --kill-after=15 "$limit" "${runner[@]}" "$stem" > "$BUILD/logs/$stem.log" 2>&1
    rc=$?
    seconds=$(( $(date +%s) - now ))
    case $rc in
        0) status=ok ;;
        1) status=FAILED ;;
        124|137) status=TIMEOUT; kill_kernels "$runtime" ;;
        *) status=CRASHED; infra=4 ;;
    esac
    printf '%s\t%s\t%s\t%s\n' "$stem" "$status" "$seconds" "$rc" >> "$STATUS"
    pack || { echo "packing failed" >&2; exit 5; }
done

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
log = (build / "logs" / "filing.log").read_text().strip()
if rc == 0 and folder.is_dir():
    figures = sorted(p.name for p in (folder / "figures").glob("*.png"))
    note = f"results/{slug}/ ({len(figures)} figures, with what earlier runs filed there)"
    # the runs' own record beside the figures: how each notebook went, on which driver, CUDA and torch (a later
    # call that runs other notebooks adds to what an earlier call filed)
    rows = [line.split("\t") for line in (build / "status.tsv").read_text().splitlines()]
    record_path = folder / "reference_run.json"
    record = json.loads(record_path.read_text()) if record_path.exists() else {"notebooks": {}}
    record["environment"] = json.loads((build / "environment.json").read_text())
    record["notebooks"].update({r[0]: {"status": r[1], "seconds": float(r[2])} for r in rows if r[1] != "not run"})
    record_path.write_text(json.dumps(record, indent=2, sort_keys=True) + "\n")
elif json.loads((build / "environment.json").read_text()).get("dry_run"):
    note = "nothing: a dry run is in check mode, and results/ holds full-mode runs only"
    shutil.rmtree(build / "filed", ignore_errors=True)
else:
    note = "nothing (" + (log.splitlines()[-1][:160] if log else f"save_results exited {rc}") + ")"
    shutil.rmtree(build / "filed", ignore_errors=True)
(build / "filed.json").write_text(json.dumps({"exit_code": rc, "note": note}) + "\n")
PY
pack || { echo "packing failed" >&2; exit 5; }

echo
cat "$OUT_DIR/summary.txt"
echo "in $OUT_DIR: $(cd "$OUT_DIR" && ls -1 | tr '\n' ' ')($(du -sh "$OUT_DIR" | cut -f1))"
exit "$infra"
