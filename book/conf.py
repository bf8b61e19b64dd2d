"""Sphinx configuration of the course's book (`make book` -> build/book/).

tools/build_book.py assembles the source folder (a generated landing page plus the executed
notebooks from build/executed/) and runs Sphinx with this folder as its configuration directory.
Nothing is executed here (myst-nb's execution is off) and nothing is fetched from the network when
a page is read: MathJax is served from the book's own _static/ folder (copied from the
`django-static-mathjax` wheel, which is MathJax 3 and nothing of Django), the theme's fonts and
icons are its own vendored copies, and the widget scripts myst-nb would take from a CDN are off.
"""

from __future__ import annotations

import shutil
from pathlib import Path

project = "Training PyTorch models in less memory and less time"
author = "the course's authors"
copyright = "the course's authors"  # noqa: A001 - Sphinx's name for it

extensions = ["myst_nb", "sphinx.ext.mathjax"]
root_doc = "index"
exclude_patterns = ["_build", "**.ipynb_checkpoints"]
suppress_warnings = ["myst.header"]  # notebooks may start a section one level deeper than the last

# --- notebooks: rendered as executed by `make run`, never executed again ------------------------
nb_execution_mode = "off"
nb_merge_streams = True            # one block per cell instead of a block per print()
nb_ipywidgets_js: dict = {}        # no require.js / widget manager from a CDN
myst_enable_extensions = ["dollarmath", "amsmath", "colon_fence"]
myst_heading_anchors = 3

# --- math, offline -------------------------------------------------------------------------------
MATHJAX_FILE = "tex-svg-full.js"   # one self-contained file: TeX input, SVG output, no web fonts
mathjax_path = f"mathjax/{MATHJAX_FILE}"
mathjax3_config = {"options": {"enableMenu": False},   # the menu would load its extensions lazily
                   "loader": {"load": []}}

# --- theme -------------------------------------------------------------------------------------
html_theme = "sphinx_book_theme"
html_title = "Less memory, less time"
html_static_path = ["_static"]
html_css_files = ["book.css"]
html_last_updated_fmt = None
html_theme_options = {
    "show_toc_level": 2,
    "use_download_button": True,      # the executed .ipynb, as make run wrote it
    "use_fullscreen_button": False,
    "home_page_in_toc": True,
    "navigation_with_keys": False,
}
html_context = {"default_mode": "auto"}  # the theme logs a console error when this is empty
html_show_sourcelink = False
html_copy_source = True               # the download button offers the executed notebook


def mathjax_source() -> Path:
    """The MathJax 3 file shipped by the ``django-static-mathjax`` wheel (see requirements.txt).

    Raises:
        FileNotFoundError: the package is not installed (install requirements.txt).
    """
    try:
        import mathjax  # the wheel's import name; it holds MathJax's release files, no Django
    except ImportError as exc:  # pragma: no cover - an installation problem, said plainly
        raise FileNotFoundError("MathJax for the offline book comes from the 'django-static-mathjax' "
                                "package: install requirements.txt (make check does)") from exc
    path = Path(mathjax.__file__).resolve().parent / "static" / "mathjax" / "es5" / MATHJAX_FILE
    if not path.exists():
        raise FileNotFoundError(f"{path} is missing from the installed django-static-mathjax package")
    return path


def _copy_mathjax(app, exception) -> None:  # noqa: ANN001 - Sphinx's callback signature
    """After an HTML build, put MathJax where ``mathjax_path`` points (inside _static/)."""
    if exception is None and app.builder.format == "html":
        target = Path(app.outdir) / "_static" / "mathjax" / MATHJAX_FILE
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(mathjax_source(), target)


def setup(app) -> dict:  # noqa: ANN001 - Sphinx's signature
    """Register the MathJax copy step."""
    app.connect("build-finished", _copy_mathjax)
    return {"parallel_read_safe": True}
