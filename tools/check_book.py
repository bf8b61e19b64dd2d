"""Checks that the built book works offline and renders: used by `make book` and tests/test_book.py.

Usage: python tools/check_book.py [BOOK_DIR] [--screenshot FILE]   (default: build/book)

- ``external_resources``: parse every page (and every stylesheet) for anything the browser would load
  from the network: ``src``/``href`` of script, link, img, iframe, source, video, audio, embed and
  object tags, ``srcset``s, and ``url(...)``/``@import`` in CSS. Links a reader clicks (``<a href>``)
  are allowed.
- ``render_pages`` (needs Chromium: ``apt-get install chromium``): open every page in one headless
  Chromium over the DevTools protocol, and report its console errors, uncaught exceptions, failed
  loads, requests that left the machine, and images that did not draw; optionally save a screenshot.
"""

from __future__ import annotations

import argparse
import base64
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass, field
from html.parser import HTMLParser
from pathlib import Path

# tag -> attributes whose value the browser fetches by itself
LOADING_ATTRIBUTES = {
    "script": ("src",), "link": ("href",), "img": ("src", "srcset"), "iframe": ("src",),
    "source": ("src", "srcset"), "video": ("src", "poster"), "audio": ("src",), "embed": ("src",),
    "object": ("data",), "input": ("src",), "track": ("src",),
}
REMOTE = re.compile(r"^\s*(?:[a-z][a-z0-9+.-]*:)?//", re.IGNORECASE)   # http://, https://, //host
LOCAL_SCHEMES = ("file:", "data:", "blob:", "about:", "chrome:", "chrome-extension:", "devtools:")
CSS_URL = re.compile(r"""url\(\s*['"]?([^'")\s]+)|@import\s+['"]([^'"]+)""", re.IGNORECASE)
CHROMIUM_FLAGS = ("--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                  "--disable-background-networking", "--disable-component-update", "--disable-sync",
                  "--disable-default-apps", "--mute-audio", "--hide-scrollbars")


def _is_remote(url: str) -> bool:
    return bool(REMOTE.match(url)) and not url.strip().lower().startswith(LOCAL_SCHEMES)


class _ResourceParser(HTMLParser):
    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.found: list[str] = []
        self._in_style = False

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        values = dict(attrs)
        rel = (values.get("rel") or "").lower()
        for name in LOADING_ATTRIBUTES.get(tag, ()):
            value = values.get(name) or ""
            if tag == "link" and name == "href" and not rel:
                continue
            urls = [part.strip().split(" ")[0] for part in value.split(",")] if name == "srcset" else [value]
            self.found += [f"<{tag} {name}={url}>" for url in urls if url and _is_remote(url)]
        if values.get("style"):
            self.found += [f"<{tag} style=url({url})>" for url in _css_urls(values["style"]) if _is_remote(url)]
        self._in_style = tag == "style"

    def handle_endtag(self, tag: str) -> None:
        if tag == "style":
            self._in_style = False

    def handle_data(self, data: str) -> None:
        if self._in_style:
            self.found += [f"<style> url({url})" for url in _css_urls(data) if _is_remote(url)]


def _css_urls(css: str) -> list[str]:
    return [a or b for a, b in CSS_URL.findall(css)]


def external_resources(book_dir: Path | str) -> list[str]:
    """Everything in the built book that a browser would load from the network, as ``page: what``.

    Raises:
        FileNotFoundError: ``book_dir`` holds no HTML pages (the book was not built there).
    """
    folder = Path(book_dir)
    pages = sorted(folder.rglob("*.html"))
    if not pages:
        raise FileNotFoundError(f"no HTML pages under {folder}: build the book first (make book)")
    problems: list[str] = []
    for page in pages:
        parser = _ResourceParser()
        parser.feed(page.read_text(errors="replace"))
        problems += [f"{page.relative_to(folder)}: {item}" for item in parser.found]
    for sheet in sorted(folder.rglob("*.css")):
        css = re.sub(r"/\*.*?\*/", "", sheet.read_text(errors="replace"), flags=re.DOTALL)
        problems += [f"{sheet.relative_to(folder)}: url({url})" for url in _css_urls(css) if _is_remote(url)]
    return problems


def find_chromium() -> str | None:
    """The Chromium (or Chrome) program to use: $CHROMIUM, /usr/bin/chromium, or one on PATH; else None."""
    candidates = [os.environ.get("CHROMIUM", ""), "/usr/bin/chromium",
                  *(shutil.which(name) or "" for name in ("chromium", "chromium-browser", "google-chrome"))]
    return next((c for c in candidates if c and Path(c).is_file() and os.access(c, os.X_OK)), None)


@dataclass
class PageReport:
    """What headless Chromium saw on one page."""

    page: str
    errors: list[str] = field(default_factory=list)         # console errors, exceptions, failed loads
    remote_requests: list[str] = field(default_factory=list)
    images: int = 0                                          # <img> elements on the page
    broken_images: list[str] = field(default_factory=list)  # images that did not draw
    output_images: int = 0                                   # images inside notebook cell outputs
    math: int = 0                                            # formulas MathJax typeset
    unrendered_math: int = 0                                 # math elements MathJax left as TeX


class _DevTools:
    """A minimal DevTools-protocol client over one page's websocket (loopback only)."""

    def __init__(self, ws_url: str) -> None:
        import websocket  # websocket-client, pinned in requirements.txt

        self.timeout_s = 60.0
        self.ws = websocket.create_connection(ws_url, suppress_origin=True, timeout=self.timeout_s)
        self.next_id = 0
        self.events: list[dict] = []

    def call(self, method: str, **params: object) -> dict:
        self.next_id += 1
        self.ws.send(json.dumps({"id": self.next_id, "method": method, "params": params}))
        self.ws.settimeout(self.timeout_s)   # wait_for() may have left a short one
        while True:
            message = json.loads(self.ws.recv())
            if message.get("id") == self.next_id:
                if "error" in message:
                    raise RuntimeError(f"DevTools {method} failed: {message['error']}")
                return message.get("result", {})
            self.events.append(message)

    def wait_for(self, method: str, timeout_s: float) -> bool:
        import websocket

        deadline = time.monotonic() + timeout_s
        if any(e.get("method") == method for e in self.events):
            return True
        while time.monotonic() < deadline:
            self.ws.settimeout(max(0.05, deadline - time.monotonic()))
            try:
                message = json.loads(self.ws.recv())
            except websocket.WebSocketTimeoutException:
                return False
            self.events.append(message)
            if message.get("method") == method:
                return True
        return False

    def drain(self, seconds: float) -> None:
        self.wait_for("__never__", seconds)

    def close(self) -> None:
        self.ws.close()


_PROBE_JS = """(async () => {
  if (window.MathJax && MathJax.startup && MathJax.startup.promise) { await MathJax.startup.promise; }
  return JSON.stringify({
    images: Array.from(document.images).map(img => ({
        src: img.getAttribute('src') || '', drawn: img.complete && img.naturalWidth > 0,
        output: !!img.closest('.cell_output, .output')})),
    math: document.querySelectorAll('mjx-container').length,
    unrendered_math: document.querySelectorAll('.math:not(:has(mjx-container))').length});
})()"""


def _start_chromium(chromium: str, profile: Path) -> tuple[subprocess.Popen, str]:
    process = subprocess.Popen([chromium, *CHROMIUM_FLAGS, f"--user-data-dir={profile}",
                                "--remote-debugging-port=0", "--window-size=1280,900", "about:blank"],
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    port_file = profile / "DevToolsActivePort"
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"{chromium} exited with {process.returncode} before opening its DevTools port")
        if port_file.exists() and len(port_file.read_text().splitlines()) >= 2:
            port = int(port_file.read_text().splitlines()[0])
            direct = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # loopback: never a proxy
            with direct.open(f"http://127.0.0.1:{port}/json/list", timeout=10) as answer:
                targets = json.loads(answer.read())
            page = next((t for t in targets if t.get("type") == "page"), None)
            if page:
                return process, page["webSocketDebuggerUrl"]
        time.sleep(0.05)
    process.kill()
    raise RuntimeError(f"{chromium} did not open its DevTools port within 30 s")


def render_pages(book_dir: Path | str, *, chromium: str | None = None, screenshot: Path | None = None,
                 settle_s: float = 0.1, timeout_s: float = 20) -> list[PageReport]:
    """Open every page of the book in headless Chromium and report what went wrong on each.

    Args:
        book_dir: the built book (its index.html is the landing page).
        chromium: the browser program (default: ``find_chromium()``).
        screenshot: where to save a PNG of the landing page (1280×900), if given.
        settle_s: how long to keep listening after a page's load event (scripts that run late, MathJax).
        timeout_s: the longest a page may take to load.

    Returns:
        One report per page, landing page first.

    Raises:
        FileNotFoundError: no Chromium, or no index.html in ``book_dir``.
        RuntimeError: the browser could not be started or driven.
    """
    folder = Path(book_dir).resolve()
    chromium = chromium or find_chromium()
    if chromium is None:
        raise FileNotFoundError("Chromium is not installed: apt-get install chromium (or set CHROMIUM)")
    if not (folder / "index.html").exists():
        raise FileNotFoundError(f"{folder / 'index.html'} does not exist: build the book first (make book)")
    # _static/ holds the theme's template fragments (*.html that are no pages): not rendered
    pages = [folder / "index.html"] + sorted(p for p in folder.rglob("*.html")
                                             if p != folder / "index.html" and "_static" not in p.relative_to(folder).parts)
    reports: list[PageReport] = []
    with tempfile.TemporaryDirectory(prefix="book-chromium-") as profile:
        process, ws_url = _start_chromium(chromium, Path(profile))
        tools = None
        try:
            tools = _DevTools(ws_url)
            for domain in ("Page", "Runtime", "Log", "Network"):
                tools.call(f"{domain}.enable")
            for page in pages:
                tools.events.clear()
                tools.call("Page.navigate", url=page.as_uri())
                report = PageReport(str(page.relative_to(folder)))
                if not tools.wait_for("Page.loadEventFired", timeout_s):
                    report.errors.append(f"did not finish loading within {timeout_s} s")
                tools.drain(settle_s)
                value = tools.call("Runtime.evaluate", expression=_PROBE_JS, returnByValue=True,
                                   awaitPromise=True)   # waits for MathJax to finish typesetting
                report.errors += _errors(tools.events)
                report.remote_requests = [e["params"]["request"]["url"] for e in tools.events
                                          if e.get("method") == "Network.requestWillBeSent"
                                          and not e["params"]["request"]["url"].startswith(LOCAL_SCHEMES)]
                probe = json.loads(value.get("result", {}).get("value", "{}"))
                images = probe.get("images", [])
                report.math, report.unrendered_math = probe.get("math", 0), probe.get("unrendered_math", 0)
                report.images = len(images)
                report.output_images = sum(1 for image in images if image["output"])
                report.broken_images = [image["src"] for image in images if not image["drawn"]]
                if screenshot is not None and page == pages[0]:
                    shot = tools.call("Page.captureScreenshot", format="png")
                    Path(screenshot).parent.mkdir(parents=True, exist_ok=True)
                    Path(screenshot).write_bytes(base64.b64decode(shot["data"]))
                reports.append(report)
        finally:
            if tools is not None:
                tools.close()
            process.terminate()
            try:
                process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                process.kill()
    return reports


def _errors(events: list[dict]) -> list[str]:
    """Console errors, uncaught exceptions and failed loads among DevTools events."""
    errors = []
    for event in events:
        method, params = event.get("method"), event.get("params", {})
        if method == "Runtime.exceptionThrown":
            details = params.get("exceptionDetails", {})
            errors.append("exception: " + (details.get("exception", {}).get("description") or details.get("text", "")))
        elif method == "Runtime.consoleAPICalled" and params.get("type") in ("error", "assert"):
            errors.append("console.error: " + " ".join(str(a.get("value", a.get("description", "")))
                                                       for a in params.get("args", [])))
        elif method == "Log.entryAdded" and params.get("entry", {}).get("level") == "error":
            entry = params["entry"]
            errors.append(f"{entry.get('source', 'log')}: {entry.get('text', '')} {entry.get('url', '')}".strip())
        elif method == "Network.loadingFailed" and not params.get("canceled"):
            errors.append(f"failed to load: {params.get('errorText', '')}")
    return errors


def browser_problems(book_dir: Path | str, *, chromium: str | None = None, screenshot: Path | None = None) -> list[str]:
    """``render_pages`` reduced to one line per problem (empty when every page rendered cleanly)."""
    return problems_of(render_pages(book_dir, chromium=chromium, screenshot=screenshot))


def problems_of(reports: list[PageReport]) -> list[str]:
    """One line per problem in the reports (empty when every page rendered cleanly)."""
    problems = []
    for report in reports:
        problems += [f"{report.page}: {error}" for error in report.errors]
        problems += [f"{report.page}: requested {url}" for url in report.remote_requests]
        problems += [f"{report.page}: image not drawn: {src}" for src in report.broken_images]
        if report.unrendered_math:
            problems.append(f"{report.page}: {report.unrendered_math} formulas not typeset by MathJax")
    return problems


def main(argv: list[str] | None = None) -> int:
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    import utils

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("book", nargs="?", type=Path, default=utils.build_dir() / "book")
    parser.add_argument("--screenshot", type=Path, default=None, help="save the landing page as this PNG")
    args = parser.parse_args(argv)
    problems = [f"loads from the network: {item}" for item in external_resources(args.book)]
    if find_chromium() is None:
        print("browser check skipped: Chromium is not installed (apt-get install chromium)")
    else:
        problems += browser_problems(args.book, screenshot=args.screenshot)
    for problem in problems:
        print(problem)
    print(f"{len(problems)} problems in {args.book}")
    return 1 if problems else 0


if __name__ == "__main__":
    raise SystemExit(main())
