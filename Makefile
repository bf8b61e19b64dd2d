# Two commands on a fresh machine: `make check` (install + every test) and `make run` (full lessons).
# Each recipe line runs in its own shell, so programs are called from the venv directly.
PYTHON ?= python3
# `make check TORCH=2.11.0` tests another torch release in a venv of its own (.venv-torch2.11.0), kept between
# runs; the pinned release (requirements.txt) lives in .venv.
TORCH ?= $(shell sed -n 's/^torch==//p' requirements.txt)
PINNED_TORCH := $(shell sed -n 's/^torch==//p' requirements.txt)
VENV := $(if $(filter $(PINNED_TORCH),$(TORCH)),.venv,.venv-torch$(TORCH))
PY := $(VENV)/bin/python
INSTALLED := $(VENV)/.installed
# Test processes run side by side (pytest-xdist), each notebook kernel with one torch thread: on a 2-core
# machine two kernels of one thread each finish sooner than one kernel of two threads after another. tests/conftest.py
# deals the long tests out evenly among the workers. The check-mode runs fork their kernels from one server per
# worker that imported torch, transformers and IPython once (tools/kernel_zygote.py; PYTORCH_INTRO_FRESH_KERNELS=1
# starts fresh ones): 18 notebooks' check runs took 108 s instead of 159 s on 2 cores. nbval's pytest plugin is off (`-p no:nbval`): the tests compare
# the marked outputs themselves, and the plugin would import jsonschema before tests/conftest.py can spare each
# process the 2 s that jsonschema's optional rfc3987_syntax costs on import.
TEST_WORKERS ?= $(shell $(PYTHON) -c "import os; print(max(1, min(4, os.cpu_count() or 1)))")

.PHONY: help check test run lab student clean

help:  ## list the targets
	@grep -E '^[a-z-]+:.*## ' $(MAKEFILE_LIST) | sed -E 's/:.*## /\t/' | expand -t 12

# The venv is a file target: it is (re)built when requirements.txt or pyproject.toml change.
$(INSTALLED): requirements.txt pyproject.toml
	$(PYTHON) -m venv $(VENV)
	sed 's/^torch==.*/torch==$(TORCH)/' requirements.txt > $(VENV)/requirements.txt
	$(PY) -m pip install --quiet -r $(VENV)/requirements.txt
	$(PY) -m pip install --quiet --no-deps -e .
	touch $@

# PYTHONDONTWRITEBYTECODE (set on some images) is cleared for the tests: every worker, notebook kernel and rank would
# otherwise recompile the course's modules and pytest would rewrite every test module's asserts again (~7 CPU-s per
# worker, ~1 s per process that imports utils); the .pyc files go to __pycache__/ (ignored).
check: $(INSTALLED)  ## create .venv, install, run every test (notebooks in check mode, in parallel)
	PYTHONDONTWRITEBYTECODE= $(PY) -m pytest -n $(TEST_WORKERS) --dist worksteal --durations=20 -p no:nbval

test: check  ## same as check

run: $(INSTALLED)  ## execute every notebook in full mode into build/ (HTML, figures, results.json)
	$(PY) tools/run_notebooks.py

lab: $(INSTALLED)  ## open JupyterLab on notebooks/
	$(VENV)/bin/jupyter lab notebooks/

student: $(INSTALLED)  ## write student versions (solutions removed) to build/student/
	$(PY) tools/build_student.py

clean:  ## remove build/ and caches (keeps .venv; `rm -rf .venv` to reinstall)
	rm -rf build .pytest_cache
	find . -name __pycache__ -not -path './.venv/*' -prune -exec rm -rf {} +

.PHONY: book results bench-check

bench-check: $(INSTALLED)  ## time make check's tests: wall, CPU, each notebook's check-mode CPU seconds (reported only)
	PYTHONDONTWRITEBYTECODE= $(PY) tools/bench_check.py

book: $(INSTALLED)  ## build the offline book in build/book/ from make run's notebooks (runs missing/stale ones first)
	$(PY) tools/build_book.py

results: $(INSTALLED)  ## file make run's full-mode figures under results/<device>/, time check mode, refresh README
	-PYTORCH_INTRO_CHECK_MODE=1 PYTORCH_INTRO_BUILD_DIR=build/check $(PY) tools/run_notebooks.py
	$(PY) tools/save_results.py --check-build build/check
	$(PY) tools/readme_results.py

.PHONY: gpu-wheels

gpu-wheels: $(INSTALLED)  ## download into .whl/ what tools/gpu_reference.sh installs on a GPU machine without Jupyter
	PYTHON=$(PY) tools/gpu_reference.sh --wheels
