"""The book (`make book`): built here, in a temporary folder, from the source notebooks plus one small
executed notebook made with nbformat, so that it needs no `make run` (CI runs a fresh clone).

One build per session (a module fixture, about 5-10 s on 2 cores); the checks on it are fast. The
browser test needs Chromium (`apt-get install chromium`) and skips, saying so, without it.
"""

from __future__ import annotations

import base64
import html
import io
import os
import re
from html.parser import HTMLParser
from pathlib import Path

import nbformat
import pytest

from tools.build_book import TABLE_MARKER, build_book, first_sentence, landing_page, notebook_table, read_page, stale
from tools.check_book import external_resources, find_chromium, render_pages
from tools.nbtools import list_notebooks

# Sphinx 9 deprecations raised inside myst-parser and sphinx-book-theme: theirs to fix, not ours
pytestmark = pytest.mark.filterwarnings("ignore:.*Check CHANGES for Sphinx API modifications")

SOURCES = list_notebooks()
EXTRA = "99_book_test_page"


def _png() -> bytes:
    """A small real PNG, drawn by matplotlib as the notebooks draw theirs."""
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(2, 1.5), dpi=50)
    ax.plot([0, 1, 2], [0, 1, 0])
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png")
    plt.close(fig)
    return buffer.getvalue()


def executed_notebook(path: Path) -> Path:
    """A notebook as `make run` leaves one: a figure, a printed table, an HTML table, math."""
    v4 = nbformat.v4
    nb = v4.new_notebook(cells=[
        v4.new_markdown_cell("# 99 · Book test page\n\nA page made by the tests. It has math: $E = mc^2$ and\n\n"
                             "$$\\text{peak} = \\sum_i b_i$$\n\n| size | MiB |\n|---|---|\n| small | 1.5 |"),
        v4.new_code_cell("print('peak: 12.5 MiB')", execution_count=1,
                         outputs=[v4.new_output("stream", name="stdout", text="peak: 12.5 MiB\n")]),
        v4.new_code_cell("plot()", execution_count=2, outputs=[v4.new_output(
            "display_data", data={"image/png": base64.b64encode(_png()).decode(), "text/plain": "<Figure>"})]),
        v4.new_code_cell("table()", execution_count=3, outputs=[v4.new_output(
            "execute_result", execution_count=3, data={
                "text/html": "<table class='measured'><tr><th>format</th><th>MiB</th></tr>"
                             "<tr><td>fp32</td><td>4.0</td></tr></table>",
                "text/plain": "format MiB\nfp32 4.0"})]),
    ])
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    nb.metadata["language_info"] = {"name": "python"}
    nbformat.write(nb, path)
    return path


@pytest.fixture(scope="session")
def book(tmp_path_factory) -> Path:
    """The test book, built once per `make check` even when pytest-xdist spreads these tests over workers."""
    from filelock import FileLock  # a dependency of torch

    base = tmp_path_factory.getbasetemp()
    shared = base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base   # one folder for all workers
    work = shared / "test-book"
    with FileLock(str(shared / "test-book.lock")):
        if not (work / "html" / "index.html").exists():
            work.mkdir(exist_ok=True)
            extra = executed_notebook(work / f"{EXTRA}.ipynb")
            build_book([*SOURCES, extra], work / "html", work_dir=work)
    return work / "html"


def _pages(book: Path) -> list[Path]:
    return sorted(p for p in book.rglob("*.html") if "_static" not in p.relative_to(book).parts)


class _Links(HTMLParser):
    def __init__(self) -> None:
        super().__init__()
        self.hrefs: list[str] = []
        self.in_nav = 0

    def handle_starttag(self, tag, attrs):
        classes = dict(attrs).get("class") or ""
        if tag == "nav" and "bd-docs-nav" in classes:
            self.in_nav = 1
        if tag == "a" and self.in_nav:
            self.hrefs.append(dict(attrs).get("href") or "")

    def handle_endtag(self, tag):
        if tag == "nav" and self.in_nav:
            self.in_nav = 0


def test_every_notebook_has_a_page_and_the_landing_page_lists_them_in_order(book):
    names = [p.stem for p in SOURCES] + [EXTRA]
    for name in names:
        assert (book / "notebooks" / f"{name}.html").exists(), name
    landing = (book / "index.html").read_text()
    positions = [landing.find(f'href="notebooks/{name}.html"') for name in names]
    assert all(p >= 0 for p in positions) and positions == sorted(positions), "the table follows course order"
    text = html.unescape(re.sub(r"<[^>]+>", "", landing))
    for curly, plain in (("\u2019", "'"), ("\u2018", "'"), ("\u201c", '"'), ("\u201d", '"')):
        text = text.replace(curly, plain)   # docutils' smart quotes
    for path in SOURCES:
        assert read_page(path).title in text, f"the landing table names {path.stem} by its title"


def test_navigation_follows_course_order_on_every_page(book):
    expected = [f"{p.stem}.html" for p in SOURCES] + [f"{EXTRA}.html"]
    for page in [book / "index.html", book / "notebooks" / f"{SOURCES[0].stem}.html"]:
        parser = _Links()
        parser.feed(page.read_text())
        # the current page links to itself as "#"
        order = [page.name if href == "#" else href.rsplit("/", 1)[-1].split("#")[0] for href in parser.hrefs]
        order = [name for name in order if name in expected]
        assert order == expected, f"{page.name}: sidebar order {order}"


def test_outputs_and_figures_are_in_the_book(book):
    html = (book / "notebooks" / f"{EXTRA}.html").read_text()
    assert "peak: 12.5 MiB" in html, "stream output"
    assert "class='measured'" in html or 'class="measured"' in html, "HTML table output"
    images = re.findall(r'<img[^>]+src="([^"]+)"', html)
    assert images, "the figure is on the page"
    for src in images:
        assert (book / "notebooks" / src).resolve().is_file(), f"{src} was not copied into the book"
    assert "E = mc^2" in html, "math is kept for MathJax to typeset"
    assert (book / "_static" / "mathjax" / "tex-svg-full.js").is_file(), "MathJax is served from the book itself"
    source_page = (book / "notebooks" / f"{SOURCES[0].stem}.html").read_text()
    assert "not run: code only" in (book / "index.html").read_text(), "the table says a page has no outputs"
    assert "cell_input" in source_page


def test_no_page_loads_anything_from_the_network(book):
    assert external_resources(book) == []


def test_offline_check_catches_external_resources(tmp_path):
    (tmp_path / "index.html").write_text(
        '<html><head><script src="https://cdn.example/require.js"></script>'
        '<link rel="stylesheet" href="//fonts.example/css"><style>@import "http://x.example/a.css";</style></head>'
        '<body><img src="http://x.example/a.png"><img src="_images/local.png"><a href="https://docs.example">ok</a>'
        '<img srcset="a.png 1x, https://x.example/b.png 2x"></body></html>')
    (tmp_path / "site.css").write_text("body { background: url('https://x.example/bg.png') }  /* url(http://no) */")
    found = external_resources(tmp_path)
    assert len(found) == 6, found
    assert not any("docs.example" in item or "local.png" in item for item in found)
    with pytest.raises(FileNotFoundError, match="build the book first"):
        external_resources(tmp_path / "nothing")


def test_browser_renders_every_page_without_errors(book):
    chromium = find_chromium()
    if chromium is None:
        pytest.skip("Chromium is not installed: apt-get install chromium (see README, 'The book')")
    screenshot = book / "landing.png"
    reports = render_pages(book, chromium=chromium, screenshot=screenshot)
    assert {r.page for r in reports} == {str(p.relative_to(book)) for p in _pages(book)}
    for report in reports:
        assert not report.errors, f"{report.page}: {report.errors}"
        assert not report.remote_requests, f"{report.page}: {report.remote_requests}"
        assert not report.broken_images, f"{report.page}: {report.broken_images}"
        assert not report.unrendered_math, f"{report.page}: formulas left as TeX"
    extra = next(r for r in reports if r.page.endswith(f"{EXTRA}.html"))
    assert extra.output_images == 1 and extra.math >= 2
    assert screenshot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_stale_notebooks_are_the_missing_and_the_outdated(tmp_path):
    sources = [tmp_path / "00_a.ipynb", tmp_path / "01_b.ipynb", tmp_path / "02_c.ipynb"]
    executed = tmp_path / "executed"
    executed.mkdir()
    for path in sources:
        path.write_text("{}")
    (executed / "00_a.ipynb").write_text("{}")
    (executed / "01_b.ipynb").write_text("{}")
    os.utime(executed / "01_b.ipynb", (0, 0))   # older than its source
    assert stale(sources, executed) == sources[1:]


def test_titles_and_table_come_from_the_notebooks(tmp_path):
    assert first_sentence("Uses `a.b` here. And more.") == "Uses `a.b` here."
    page = read_page(SOURCES[0])
    assert page.number == "00" and page.title and page.pitch.endswith(".")
    bad = tmp_path / "bad.ipynb"
    nbformat.write(nbformat.v4.new_notebook(cells=[nbformat.v4.new_markdown_cell("Untitled")]), bad)
    with pytest.raises(ValueError, match="numbered title"):
        read_page(bad)
    template = tmp_path / "landing.md"
    template.write_text("# Book\n")
    with pytest.raises(ValueError, match=TABLE_MARKER):
        landing_page([page], None, set(), template=template)


def test_landing_table_names_the_run_behind_each_page():
    page = read_page(SOURCES[0])
    runtimes = {"modes": {
        "check": {page.stem: {"seconds": 5.0, "ok": True, "device": "AMD EPYC, 2 threads", "finished": "2026-01-01T00:00"}},
        "full": {page.stem: {"seconds": 61.0, "ok": False, "device": "AMD EPYC, 2 threads", "finished": "2026-01-02T00:00"}},
    }}
    table = notebook_table([page], runtimes, {page.stem})
    assert "full mode, 61 s on AMD EPYC, 2 threads, **failed**" in table, "the latest run, and that it failed"
    assert f"[{page.title}](notebooks/{page.stem}.ipynb)" in table
    assert "not run: code only" in notebook_table([page], runtimes, set())
    assert "```{toctree}" in table and f"notebooks/{page.stem}\n" in table


def test_browser_check_catches_errors_requests_and_missing_figures(tmp_path):
    chromium = find_chromium()
    if chromium is None:
        pytest.skip("Chromium is not installed: apt-get install chromium (see README, 'The book')")
    (tmp_path / "index.html").write_text(
        "<html><body><script>console.error('boom')</script><img src='missing.png'>"
        # loopback, port 9 (discard): nothing leaves the machine, yet it is a request to the network
        "<img src='http://127.0.0.1:9/figure.png'></body></html>")
    report, = render_pages(tmp_path, chromium=chromium)
    assert any("boom" in error for error in report.errors), report.errors
    assert any(url.startswith("http://127.0.0.1:9/") for url in report.remote_requests)
    assert len(report.broken_images) == 2
