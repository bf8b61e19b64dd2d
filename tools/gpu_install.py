"""What the GPU reference run must install on a GPU image, and only that: the image's own packages are used.

The GPU machines run whatever image they have: the usual one carries torch, transformers, peft, numpy and
matplotlib but no Jupyter; a bare one may carry Python and torch alone. ``tools/gpu_reference.sh`` carries
wheels in ``.whl/`` (``make gpu-wheels``) and asks this module which of them to install: it follows each
requirement's ``Requires-Dist`` through the wheels' own metadata, leaves out every distribution the image
already has (any version: the image's packages were chosen to work with its torch; transformers and peft, whose
exact versions the calculator is validated against, are installed over the image's when their wheels are carried),
and prints the wheel files
of the rest, which the script installs with ``pip install --no-deps --target`` into a folder on ``PYTHONPATH``.

Only the standard library is used (the bare image may lack ``packaging``); an environment marker other than an
extra is evaluated with ``packaging`` where it is installed, else the requirement is kept (one wheel too many
is harmless; one too few fails at import).

    python tools/gpu_install.py --wheels .whl papermill nbclient ipykernel matplotlib
"""
from __future__ import annotations

import argparse
import importlib.metadata
import re
import sys
import zipfile
from email.parser import Parser
from pathlib import Path

# What a run imports: the notebook runner and kernel, the plots, pytest for the CUDA unit tests, and the libraries
# the notebooks train with. torch is the image's and is never installed from wheels.
RUN_REQUIREMENTS = ["papermill", "nbclient", "nbformat", "nbconvert", "ipykernel", "matplotlib", "pytest",
                    "transformers", "peft"]
NEVER_INSTALLED = {"torch", "triton"}
# What an image with Python and torch alone holds besides torch: torch's own requirements (its wheel's METADATA).
TORCH_BRINGS = {"filelock", "typing-extensions", "sympy", "mpmath", "networkx", "jinja2", "markupsafe", "fsspec",
                "setuptools"}
# What a "bare" image must still hold besides Python and torch for `make gpu-wheels --bare` (everything else) to fit
# the 64 MiB a device call carries with the tree: these wheels alone are 40 MB (numpy 16, matplotlib 10, pillow 7,
# fonttools 5 and more). Any image that runs torch notebooks has them.
BARE_IMAGE_HAS = {"numpy", "pillow", "matplotlib", "fonttools", "kiwisolver", "contourpy"}
# The GPU machines' Python: markers are evaluated for it when the wheels are chosen on another Python (make gpu-wheels).
IMAGE_PYTHON = "3.12"
# The libraries whose exact version the course's byte predictions are validated against (the calculator's
# transformers and peft replay, requirements.txt's pins): where the wheels carry that version and the image holds
# another, the carried one is installed over it (on PYTHONPATH, ahead of the image's).
PINNED_EXACTLY = {"transformers", "peft"}
_NAME = re.compile(r"^\s*([A-Za-z0-9][A-Za-z0-9._-]*)")


def canonical(name: str) -> str:
    """PEP 503's normalised name: ``Jinja2`` and ``jinja2``, ``python_dateutil`` and ``python-dateutil`` agree."""
    return re.sub(r"[-_.]+", "-", name).lower()


def wheel_index(folder: Path) -> dict[str, Path]:
    """The wheels in ``folder`` by canonical distribution name (the first part of a wheel's file name)."""
    return {canonical(path.name.split("-")[0]): path for path in sorted(folder.glob("*.whl"))}


def wheel_requirements(wheel: Path, python: str | None = None) -> list[str]:
    """The names a wheel requires (its METADATA's ``Requires-Dist``), extras-only requirements left out; markers are
    evaluated for this interpreter, or for Python ``python`` ("3.12") where given."""
    with zipfile.ZipFile(wheel) as archive:
        metadata_name = next(n for n in archive.namelist() if n.endswith(".dist-info/METADATA"))
        metadata = Parser().parsestr(archive.read(metadata_name).decode("utf-8", "replace"))
    names = []
    for requirement in metadata.get_all("Requires-Dist") or []:
        spec, _, marker = requirement.partition(";")
        if "extra" in marker or not _marker_holds(marker.strip(), python):
            continue
        match = _NAME.match(spec)
        if match:
            names.append(canonical(match.group(1)))
    return names


_ATOM = re.compile(r"""(\w+)\s*(==|!=|<=|>=|<|>|not in|in)\s*["']([^"']*)["']""")


def _marker_holds(marker: str, python: str | None = None) -> bool:
    """Whether an environment marker holds here (or on Python ``python``, e.g. "3.12": papermill needs aiohttp on 3.12
    only): with ``packaging`` where it is installed, else with a small evaluator of ``name op "value"`` terms joined by
    and/or (a marker it cannot read is kept)."""
    if not marker:
        return True
    override = {"python_version": python, "python_full_version": f"{python}.0"} if python else {}
    try:
        from packaging.markers import Marker
        return Marker(marker).evaluate(override or None)
    except ImportError:          # a bare image
        pass
    except Exception:            # a marker this packaging cannot read: keep the requirement
        return True
    import os
    import platform
    values = {"sys_platform": sys.platform, "platform_system": platform.system(), "os_name": os.name,
              "platform_machine": platform.machine(), "implementation_name": sys.implementation.name,
              "platform_python_implementation": platform.python_implementation(),
              "python_version": ".".join(map(str, sys.version_info[:2])),
              "python_full_version": platform.python_version(), **override}

    def version(text: str) -> tuple:
        return tuple(int(part) if part.isdigit() else 0 for part in text.split("."))

    def atom(match: re.Match) -> str:
        name, op, wanted = match.groups()
        if name not in values:
            raise KeyError(name)
        have = values[name]
        if name.startswith("python"):
            have, wanted = version(have), version(wanted)
        result = {"==": have == wanted, "!=": have != wanted, "<": have < wanted, "<=": have <= wanted,
                  ">": have > wanted, ">=": have >= wanted, "in": str(have) in str(wanted),
                  "not in": str(have) not in str(wanted)}[op]
        return str(result)
    try:
        expression = _ATOM.sub(atom, marker)
    except KeyError:
        return True
    if not re.fullmatch(r"[\s()]*((True|False)[\s()]*((and|or)[\s()]*)?)+", expression):
        return True
    return bool(eval(expression, {"__builtins__": {}}))   # only True/False/and/or/brackets remain


def wheel_version(wheel: Path) -> str:
    """The version in a wheel's file name (``transformers-5.24.0-py3-none-any.whl`` -> ``5.24.0``)."""
    return wheel.name.split("-")[1]


def installed(name: str, version: str | None = None) -> bool:
    """Whether this interpreter (with its PYTHONPATH) already has the distribution: in any version, or in exactly
    ``version`` when one is given."""
    try:
        have = importlib.metadata.distribution(name).version
    except importlib.metadata.PackageNotFoundError:
        return False
    return version is None or have == version


def to_install(requirements: list[str], wheels: dict[str, Path], *, python: str | None = None,
               bare: bool = False) -> tuple[list[Path], list[str]]:
    """(wheels to install, names missing from both the image and the wheels), following dependencies.

    A requirement the image already has is not followed further: its own dependencies are the image's. With
    ``bare`` the image is taken to hold Python and torch alone (``TORCH_BRINGS``), whatever this interpreter has;
    ``python`` evaluates the wheels' markers for that version (``make gpu-wheels`` runs on another Python).
    """
    chosen: dict[str, Path] = {}
    unavailable: list[str] = []
    stack = [canonical(r) for r in requirements]
    seen: set[str] = set()
    while stack:
        name = stack.pop()
        if name in seen or name in NEVER_INSTALLED:
            continue
        seen.add(name)
        wheel = wheels.get(name)
        exact = wheel_version(wheel) if wheel is not None and name in PINNED_EXACTLY else None
        if (name in TORCH_BRINGS | BARE_IMAGE_HAS) if bare else installed(name, exact):
            continue
        if wheel is None:
            unavailable.append(name)
            continue
        chosen[name] = wheel
        stack.extend(wheel_requirements(wheel, python))
    return [chosen[n] for n in sorted(chosen)], sorted(unavailable)


def main(argv: list[str] | None = None) -> int:
    """Print the wheel files to install, one per line; exit 1 (naming them) when a needed one is not carried."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("requirements", nargs="*", default=None, help=f"default: {' '.join(RUN_REQUIREMENTS)}")
    parser.add_argument("--wheels", type=Path, required=True, help="the folder of carried wheels (.whl/)")
    parser.add_argument("--python", default=None, help=f"evaluate markers for this Python (e.g. {IMAGE_PYTHON})")
    parser.add_argument("--bare", action="store_true", help="as on an image with Python and torch alone")
    parser.add_argument("--missing", action="store_true",
                        help="print only the names neither the image nor the wheels have (make gpu-wheels fetches them)")
    args = parser.parse_args(argv)
    if not args.wheels.is_dir():
        print(f"gpu_install: {args.wheels} is not a folder of wheels (make gpu-wheels makes .whl/)", file=sys.stderr)
        return 2
    wheels, unavailable = to_install(args.requirements or RUN_REQUIREMENTS, wheel_index(args.wheels),
                                     python=args.python, bare=args.bare)
    if args.missing:
        print("\n".join(unavailable))
        return 0
    for wheel in wheels:
        print(wheel)
    if unavailable:
        print(f"gpu_install: neither the image nor {args.wheels} has: {' '.join(unavailable)} "
              "(make gpu-wheels --bare carries everything but torch)", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
