"""Refresh tests/nbval_expected.json: the outputs of cells marked `# NBVAL_CHECK_OUTPUT`, in check mode on CPU.

Run it after changing a marked cell on purpose, and review the diff: these outputs are meant to stay stable.
Usage: CUDA_VISIBLE_DEVICES= .venv/bin/python tools/update_nbval_expected.py
"""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tools.nbtools import ROOT, execute, list_notebooks  # noqa: E402


def main() -> int:
    expected: dict[str, dict[str, str]] = {}
    with tempfile.TemporaryDirectory() as build:
        for path in list_notebooks():
            executed = execute(path, Path(build) / path.name, check_mode=True, build=Path(build))
            marked = {}
            for cell in executed.cells:
                if cell.cell_type == "code" and "# NBVAL_CHECK_OUTPUT" in cell.source:
                    marked[cell.id] = "".join(o.get("text", "") for o in cell.outputs if o.output_type == "stream")
            if marked:
                expected[path.stem] = marked
    (ROOT / "tests" / "nbval_expected.json").write_text(json.dumps(expected, indent=2) + "\n")
    print(f"updated tests/nbval_expected.json for {sorted(expected)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
