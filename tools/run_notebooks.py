"""`make run`: execute every notebook in full mode into build/, render HTML, gather results.

Usage: python tools/run_notebooks.py [NOTEBOOK_STEM ...]   (default: all notebooks)
Set PYTORCH_INTRO_CHECK_MODE=1 to run the fast path instead (the executed copies say which).
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from nbconvert import HTMLExporter  # noqa: E402

import utils  # noqa: E402
from tools.nbtools import execute, list_notebooks  # noqa: E402
from utils.results import main as summarize  # noqa: E402


def main(argv: list[str]) -> int:
    check = utils.check_mode()  # an invalid value fails here, before anything runs
    build = utils.build_dir()
    notebooks = list_notebooks()
    if argv:
        notebooks = [nb for nb in notebooks if nb.stem in argv or nb.stem[:2] in argv]
        if not notebooks:
            print(f"no notebook matches {argv}", file=sys.stderr)
            return 2
    print(f"{'check' if check else 'full'} mode, into {build}")
    for notebook in notebooks:
        started = time.perf_counter()
        executed = build / "executed" / notebook.name
        nb = execute(notebook, executed, check_mode=check, build=build, timeout_s=3600)
        html, _ = HTMLExporter().from_notebook_node(nb)
        html_path = build / "html" / f"{notebook.stem}.html"
        html_path.parent.mkdir(parents=True, exist_ok=True)
        html_path.write_text(html)
        print(f"  {notebook.stem}: {time.perf_counter() - started:.1f} s -> {executed.relative_to(build.parent)}")
    print()
    return summarize([])


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
