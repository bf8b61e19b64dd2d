"""Shared test set-up: the repo root on sys.path (for tools/), a non-interactive matplotlib."""

import os
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
os.environ.setdefault("PYDEVD_DISABLE_FILE_VALIDATION", "1")  # quiets the kernel's debugger warning
