"""`make student`: write student versions of every notebook to build/student/ with nbgrader.

Solution regions (### BEGIN SOLUTION / ### END SOLUTION) become `raise NotImplementedError()`,
outputs are cleared, and the read-only test cells are locked, exactly as `nbgrader
generate_assignment` does. Instructors who run nbgrader itself can copy notebooks/ into their
course's source/<assignment>/ folder instead.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import nbformat  # noqa: E402

import utils  # noqa: E402
from tools.nbtools import list_notebooks, student_version  # noqa: E402


def main() -> int:
    out_dir = utils.build_dir() / "student"
    out_dir.mkdir(parents=True, exist_ok=True)
    for notebook in list_notebooks():
        student = student_version(nbformat.read(notebook, as_version=4))
        nbformat.write(student, out_dir / notebook.name)
        print(f"  {out_dir / notebook.name}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
