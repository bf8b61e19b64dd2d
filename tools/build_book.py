"""`make book`: turn the executed notebooks of `make run` into a browsable, offline book in build/book/.

Usage: python tools/build_book.py [--no-run] [--no-browser]

1. Every notebook whose executed copy (build/executed/) is missing or older than its source is run
   first, by tools/run_notebooks.py (in the mode PYTORCH_INTRO_CHECK_MODE selects). With --no-run
   the executed copies are used as they are, and a notebook without one goes into the book as its
   source, without outputs (the landing table says so).
2. A source folder is assembled in build/book-src/: a landing page (book/landing.md with the
   notebook table generated from the notebooks' titles and first sentences, and the run behind each
   page from build/runtimes.json) and the executed notebooks in course order.
3. Sphinx builds it with book/conf.py (myst-nb with execution off: nothing runs here).
4. tools/check_book.py checks that no page loads anything from the network, and, when Chromium is
   installed, renders every page headless (no console errors, every figure drawn) and saves a
   screenshot of the landing page as build/book/landing.png.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import nbformat  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
BOOK_CONF = ROOT / "book"
TABLE_MARKER = "<!-- notebook-table -->"
START_MARKER = "<!-- start-here -->"   # optional: the README's reading paths go there
TITLE = re.compile(r"^#\s+(\d\d)\s*·\s*(.+?)\s*$")


@dataclass(frozen=True)
class Page:
    """One notebook of the book: where its file is, its number and title, and its first sentence."""

    path: Path
    stem: str
    number: str
    title: str
    pitch: str


def read_page(path: Path) -> Page:
    """Read a notebook's number, title and pitch from its first cell (``# 03 · Title`` + a paragraph).

    Raises:
        ValueError: the first cell is not a markdown cell starting with a numbered title.
    """
    nb = nbformat.read(path, as_version=4)
    first = next((c for c in nb.cells if c.cell_type == "markdown"), None)
    lines = (first.source if first is not None else "").strip().splitlines()
    match = TITLE.match(lines[0]) if lines else None
    if match is None:
        raise ValueError(f"{path}: the first markdown cell must start with a numbered title like "
                         f"'# 03 · Activation checkpointing', found {lines[0] if lines else 'nothing'!r}")
    paragraph = ""
    for line in lines[1:]:
        if line.strip():
            paragraph += " " + line.strip()
        elif paragraph:
            break
    return Page(path, path.stem, match.group(1), match.group(2), first_sentence(paragraph.strip()))


def first_sentence(text: str) -> str:
    """The first sentence of a paragraph (up to the first '. ' outside backticks), or the paragraph."""
    depth = 0
    for index, char in enumerate(text):
        if char == "`":
            depth ^= 1
        elif char in ".:" and not depth and text[index + 1:index + 2] in (" ", ""):
            return text[:index + 1] if char == "." else text[:index] + "."
    return text


def latest_run(runtimes: dict | None, stem: str) -> tuple[str, dict] | None:
    """The most recent (mode, entry) that build/runtimes.json holds for a notebook, if any."""
    if not runtimes:
        return None
    found = [(entry.get("finished", ""), mode, entry)
             for mode, entries in runtimes.get("modes", {}).items() if stem in entries
             for entry in [entries[stem]]]
    if not found:
        return None
    _, mode, entry = max(found, key=lambda item: item[0])
    return mode, entry


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def _reading_minutes(page: Page) -> int:
    """The README's reading-time estimate for one notebook (tools/readme_results.py holds the rule)."""
    from tools.readme_results import reading_minutes
    return reading_minutes(json.loads(page.path.read_text()))


def start_here(pages: list[Page]) -> str:
    """The README's "Start here" reading paths (tools/readme_results.START_HERE), as links between pages.

    A path skips a notebook the book does not hold, as the README does.
    """
    from tools.readme_results import START_HERE
    by_number = {page.number: page for page in pages}
    lines = ["Pick the question you came with and read those notebooks in that order "
             "(minutes are reading time, not run time); each one says what it expects you to know.", ""]
    for question, numbers in START_HERE:
        path = [by_number[n] for n in numbers if n in by_number]
        if path:
            lines.append(f"- **{question}**: " + " → ".join(
                f"[{p.number} {p.title.split(':')[0]}](notebooks/{p.stem}.ipynb) ({_reading_minutes(p)} min)"
                for p in path))
    return "\n".join(lines) + "\n"


def notebook_table(pages: list[Page], runtimes: dict | None, executed: set[str]) -> str:
    """The landing page's table (MyST markdown) and the hidden toctree that orders the navigation."""
    rows = ["| # | notebook | what it is about | reading | this book's run |", "|---|---|---|---|---|"]
    for page in pages:
        run = latest_run(runtimes, page.stem) if page.stem in executed else None
        if page.stem not in executed:
            ran = "not run: code only"
        elif run is None:
            ran = "executed (no record of the run)"
        else:
            mode, entry = run
            state = "" if entry.get("ok", True) else ", **failed**"
            ran = f"{mode} mode, {entry['seconds']:.0f} s on {entry.get('device', 'an unnamed device')}{state}"
        link = f"[{_cell(page.title)}](notebooks/{page.stem}.ipynb)"
        rows.append(f"| {page.number} | {link} | {_cell(page.pitch)} | {_reading_minutes(page)} min | {_cell(ran)} |")
    toctree = ["```{toctree}", ":hidden:", ":maxdepth: 1", ":caption: Notebooks", ""]
    toctree += [f"notebooks/{page.stem}" for page in pages]
    toctree.append("```")
    return "\n".join(rows) + "\n\n" + "\n".join(toctree) + "\n"


def landing_page(pages: list[Page], runtimes: dict | None, executed: set[str],
                 template: Path = BOOK_CONF / "landing.md") -> str:
    """book/landing.md with the notebook table in place of its marker comment.

    Raises:
        ValueError: the template lacks the marker (the table would have nowhere to go).
    """
    text = template.read_text()
    if TABLE_MARKER not in text:
        raise ValueError(f"{template} must contain the line {TABLE_MARKER} where the notebook table goes")
    text = text.replace(START_MARKER, start_here(pages))
    return text.replace(TABLE_MARKER, notebook_table(pages, runtimes, executed))


def has_outputs(path: Path) -> bool:
    """Whether any code cell of the notebook holds outputs (an executed copy rather than a source)."""
    nb = nbformat.read(path, as_version=4)
    return any(c.get("outputs") for c in nb.cells if c.cell_type == "code")


def image_outputs(path: Path) -> int:
    """How many figures (image outputs) the notebook's code cells hold."""
    nb = nbformat.read(path, as_version=4)
    return sum(1 for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", [])
               if any(key.startswith("image/") for key in o.get("data", {})))


def assemble(notebooks: list[Path], source_dir: Path, runtimes: dict | None = None) -> list[Page]:
    """Write the Sphinx source folder: index.md and notebooks/*.ipynb, in the order given.

    Args:
        notebooks: one file per notebook, in course order: the executed copy where there is one,
            else the source (it goes in without outputs, and the table says so).
        source_dir: the folder to (re)create; everything in it is replaced.
        runtimes: the contents of build/runtimes.json, for the table's "this book's run" column.

    Returns:
        The pages, in order.

    Raises:
        ValueError: no notebooks, two with the same name, or one without a numbered title.
    """
    if not notebooks:
        raise ValueError("no notebooks to make a book of")
    names = [p.name for p in notebooks]
    if len(set(names)) != len(names):
        raise ValueError(f"two notebooks share a name: {sorted(names)}")
    pages = [read_page(p) for p in notebooks]
    if source_dir.exists():
        shutil.rmtree(source_dir)
    (source_dir / "notebooks").mkdir(parents=True)
    for page in pages:
        shutil.copyfile(page.path, source_dir / "notebooks" / page.path.name)
    executed = {page.stem for page in pages if has_outputs(page.path)}
    (source_dir / "index.md").write_text(landing_page(pages, runtimes, executed))
    return pages


def sphinx_build(source_dir: Path, out_dir: Path, *, doctrees: Path | None = None,
                 conf_dir: Path = BOOK_CONF, quiet: bool = True) -> None:
    """Run Sphinx's HTML builder on an assembled folder, in this process.

    In-process rather than a subprocess because importing Sphinx, myst-nb and nbformat's schema
    validator costs seconds that a test process has often paid already.

    Raises:
        RuntimeError: Sphinx failed (its messages are on stderr above).
    """
    from sphinx.cmd.build import build_main

    args = ["-b", "html", "-c", str(conf_dir), "-d", str(doctrees or out_dir.parent / f"{out_dir.name}-doctrees"),
            str(source_dir), str(out_dir)]
    code = build_main(["-q", *args] if quiet else args)
    if code != 0:
        raise RuntimeError(f"sphinx-build failed with exit code {code} on {source_dir} (its messages are above)")


def build_book(notebooks: list[Path], out_dir: Path, *, work_dir: Path | None = None,
               runtimes: dict | None = None) -> list[Page]:
    """Assemble and build the book from notebooks that are already executed (nothing runs here).

    Args:
        notebooks: one file per notebook in course order (see ``assemble``).
        out_dir: where the HTML goes (replaced).
        work_dir: where the Sphinx source folder and doctrees go (default: beside ``out_dir``).
        runtimes: build/runtimes.json's contents, for the landing table.

    Returns:
        The pages, in order.
    """
    work = work_dir or out_dir.parent
    source_dir = work / f"{out_dir.name}-src"
    pages = assemble(notebooks, source_dir, runtimes)
    if out_dir.exists():
        shutil.rmtree(out_dir)
    sphinx_build(source_dir, out_dir, doctrees=work / f"{out_dir.name}-doctrees")
    return pages


def stale(sources: list[Path], executed_dir: Path) -> list[Path]:
    """The source notebooks whose executed copy is missing or older than the source."""
    return [src for src in sources
            if not (executed_dir / src.name).exists()
            or (executed_dir / src.name).stat().st_mtime < src.stat().st_mtime]


def load_runtimes(build: Path) -> dict | None:
    """build/runtimes.json, or None when `make run` has not written it (or it is unreadable)."""
    path = build / "runtimes.json"
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        return None
    except json.JSONDecodeError:
        print(f"warning: {path} is not valid JSON; the table will not name the runs", file=sys.stderr)
        return None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--no-run", action="store_true",
                        help="use the executed copies as they are (stale or not); a missing one: the source")
    parser.add_argument("--no-browser", action="store_true", help="skip the headless-Chromium check")
    args = parser.parse_args(argv)

    import utils
    from tools.check_book import external_resources, find_chromium, problems_of, render_pages
    from tools.nbtools import list_notebooks

    utils.check_mode()  # an invalid PYTORCH_INTRO_CHECK_MODE fails before anything runs
    build = utils.build_dir()
    executed_dir = build / "executed"
    sources = list_notebooks()
    todo = stale(sources, executed_dir)
    run_failed = False
    if todo and not args.no_run:
        print(f"running first (missing or older than their source): {', '.join(p.stem for p in todo)}", flush=True)
        done = subprocess.run([sys.executable, str(ROOT / "tools" / "run_notebooks.py"), *[p.stem for p in todo]],
                              env=os.environ.copy())
        run_failed = done.returncode != 0
    chosen = [executed_dir / src.name if (executed_dir / src.name).exists() else src for src in sources]
    missing = [p.stem for p in chosen if p.parent != executed_dir]
    if missing:
        print(f"warning: no executed copy of {', '.join(missing)}: these pages show code only", file=sys.stderr)

    out_dir = build / "book"
    started = dt.datetime.now()
    pages = build_book(chosen, out_dir, runtimes=load_runtimes(build))
    print(f"built {len(pages)} notebooks into {out_dir} in {(dt.datetime.now() - started).total_seconds():.1f} s")

    problems = [f"loads from the network: {item}" for item in external_resources(out_dir)]
    chromium = find_chromium()
    if args.no_browser:
        print("browser check skipped (--no-browser)")
    elif chromium is None:
        print("browser check skipped: Chromium is not installed (apt-get install chromium)")
    else:
        screenshot = out_dir / "landing.png"
        reports = render_pages(out_dir, chromium=chromium, screenshot=screenshot)
        problems += problems_of(reports)
        drawn = {Path(r.page).stem: r.output_images for r in reports}
        for page in pages:
            expected = image_outputs(page.path)
            if drawn.get(page.stem, 0) != expected:
                problems.append(f"{page.stem}: {drawn.get(page.stem, 0)} figures drawn, the notebook has {expected}")
        print(f"rendered every page in {chromium}; landing page screenshot: {screenshot}")
    for problem in problems:
        print(f"  problem: {problem}", file=sys.stderr)
    print(f"open {out_dir / 'index.html'}")
    if run_failed:
        print("some notebooks failed in make run (see above); their pages show the error", file=sys.stderr)
    return 1 if problems or run_failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
