"""Notebook kernels forked from one pre-imported Python, for the check-mode tests (tools/nbtools.run_check_mode).

Why: every check-mode run starts a fresh kernel, and a fresh kernel imports IPython, ipykernel, torch, transformers
and matplotlib again before its first cell computes anything: about 3 of the 5-25 CPU seconds a notebook's check
run costs, 18 times per `make check`. Here one server per test process imports them once; each kernel is a fork of
it that then starts ipykernel exactly as ``python -m ipykernel_launcher -f CONNECTION_FILE`` would, with the
environment and working folder the kernel manager gave it. The kernel is real (nbclient talks to it over ZeroMQ as
to any other); only how its process came to be differs.

Three pieces:

- :class:`KernelZygote` (in the test process) starts the server and hands nbclient a kernel spec whose command is
  this file's ``client``;
- the ``serve`` command (the server) imports, listens on a Unix socket, forks a kernel per connection, and kills
  that kernel when its connection closes (its client was killed), reporting its exit status otherwise;
- the ``client`` command (what the kernel manager starts, and signals, and waits for) asks the server for a kernel,
  passes on every signal it receives (an interrupt reaches the running cell), and exits with the kernel's status.

Set ``PYTORCH_INTRO_FRESH_KERNELS=1`` to run the check-mode tests on fresh kernels instead (they always do on a
machine with CUDA, and on Windows). The nbgrader round trip's autograde (tests/test_grading.py) forks its kernels
from the same server; `make run`, papermill and an instructor's `nbgrader autograde` start fresh kernels as ever.

Usage (what KernelZygote runs): ``python tools/kernel_zygote.py serve SOCKET [MODULE,MODULE,...]`` and
``python tools/kernel_zygote.py client SOCKET -f CONNECTION_FILE``.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import sys

FRESH_KERNELS_VARIABLE = "PYTORCH_INTRO_FRESH_KERNELS"
# imported once in the server: what every notebook's kernel imports before its first cell computes
# (not matplotlib.pyplot: its inline backend hooks itself into IPython when first imported inside the kernel)
PRELOAD = ("ipykernel.kernelapp", "ipykernel.ipkernel", "IPython", "numpy", "torch", "torch.nn.functional",
           "torch.utils.checkpoint", "matplotlib", "transformers", "transformers.modeling_utils")
# signals the client passes on to its kernel (SIGKILL cannot be caught: the server notices the closed connection)
FORWARDED = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1, signal.SIGUSR2)


def _send(connection: socket.socket, message: dict) -> None:
    connection.sendall(json.dumps(message).encode() + b"\n")


def _receive(stream) -> dict | None:
    line = stream.readline()
    return json.loads(line) if line else None


def client(socket_path: str, kernel_argv: list[str]) -> int:
    """Ask the server at ``socket_path`` for a kernel run with ``kernel_argv``; forward signals; return its status."""
    connection = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    connection.connect(socket_path)
    stream = connection.makefile("r")
    _send(connection, {"argv": kernel_argv, "env": dict(os.environ), "cwd": os.getcwd()})
    started = _receive(stream)
    if not started or "pid" not in started:
        print(f"kernel_zygote: the server did not start a kernel: {started}", file=sys.stderr)
        return 1
    pid = started["pid"]

    def forward(signum, _frame):
        try:
            os.kill(pid, signum)
        except ProcessLookupError:
            pass

    for signum in FORWARDED:
        signal.signal(signum, forward)
    while True:
        try:
            ended = _receive(stream)
            break
        except InterruptedError:                     # a forwarded signal interrupted the read: read on
            continue
    return int(ended["status"]) if ended else 1


def _start_kernel(request: dict, listener: socket.socket, connection: socket.socket) -> None:
    """In the forked child: become the kernel the request describes (never returns)."""
    status = 1
    try:
        listener.close()
        connection.close()
        for signum in FORWARDED:
            signal.signal(signum, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.default_int_handler)     # as in a fresh Python; ipykernel takes it over
        os.environ.clear()
        os.environ.update(request["env"])
        os.chdir(request["cwd"])
        threads = os.environ.get("OMP_NUM_THREADS", "")
        if threads.isdigit() and int(threads) > 0 and "torch" in sys.modules:
            import torch    # imported by the server, before this environment: its thread pool starts at the first op

            torch.set_num_threads(int(threads))
        argv = list(request["argv"])
        # ipykernel read JPY_PARENT_PID (the kernel manager's pid) when the server imported it, before this kernel's
        # environment existed: give it as the option it is the default of (it also keeps the connection banner off)
        if os.environ.get("JPY_PARENT_PID", "").isdigit():
            argv.append(f"--IPKernelApp.parent_handle={os.environ['JPY_PARENT_PID']}")
        sys.argv = ["ipykernel_launcher", *argv]
        from ipykernel import kernelapp

        kernelapp.launch_new_instance(argv=argv)
        status = 0
    except SystemExit as exit_:
        status = exit_.code if isinstance(exit_.code, int) else 1
    except BaseException:                                # noqa: BLE001  (its traceback goes to the test's stderr)
        import traceback

        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(status)


def serve(socket_path: str, preload: tuple[str, ...] = PRELOAD) -> int:
    """Import ``preload``, then fork a kernel per connection until the process that started the server is gone."""
    import importlib
    import selectors

    parent = os.getppid()
    # what ipykernel sets before the first import of matplotlib: its inline backend, unless the caller chose one
    os.environ.setdefault("MPLBACKEND", "module://matplotlib_inline.backend_inline")
    for module in preload:
        try:
            importlib.import_module(module)
        except ImportError:                              # optional ones (transformers) just are not preloaded
            pass
    if "matplotlib" in preload:
        _draw_a_figure()
    import gc

    gc.collect()
    gc.freeze()         # the imported objects stay out of the kernels' collections: fewer pages copied after fork
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(socket_path)
    listener.listen(16)
    selector = selectors.DefaultSelector()
    selector.register(listener, selectors.EVENT_READ)
    kernels: dict[int, socket.socket] = {}               # kernel pid -> its client's connection
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))   # KernelZygote.stop: the kernels go with the server
    try:
        _serve_loop(listener, selector, kernels, parent)
    finally:
        for pid in kernels:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    return 0


def _draw_a_figure() -> None:
    """Draw and save one figure with text, a legend and a second axis, off-screen (Agg, not pyplot): the modules and
    caches a notebook's first figure would fill (tick formatting, text layout, the legend, the PNG writer) are then
    filled once here for every kernel (a forked kernel's first figure then took 0.18 CPU-s instead of 0.42)."""
    try:
        import io

        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError:
        return
    figure = Figure(figsize=(4, 3))
    FigureCanvasAgg(figure)
    axis = figure.subplots()
    axis.bar(["a", "b"], [1.0, 2.0], label="bars")
    axis.twinx().plot([0, 1], [3.0, 1.0], "ko-", label="line")
    axis.set_xlabel("micro-batches × size")
    axis.set_title("a title\nwith $x^2$ in it")
    axis.legend(loc="upper right", fontsize="small")
    figure.tight_layout()
    figure.savefig(io.BytesIO(), format="png", dpi=110)


def _serve_loop(listener: socket.socket, selector, kernels: dict[int, socket.socket], parent: int) -> None:
    """Fork a kernel per connection, report ended kernels, until the server's parent is gone."""
    import selectors

    while os.getppid() == parent:
        for key, _ in selector.select(timeout=0.2):
            if key.fileobj is listener:
                connection, _ = listener.accept()
                request = _receive(connection.makefile("r"))
                if request is None:
                    connection.close()
                    continue
                sys.stdout.flush()
                sys.stderr.flush()
                pid = os.fork()
                if pid == 0:
                    _start_kernel(request, listener, connection)
                kernels[pid] = connection
                _send(connection, {"pid": pid})
                selector.register(connection, selectors.EVENT_READ, pid)
            else:                                        # the client's connection closed: it was killed
                pid = key.data
                selector.unregister(key.fileobj)
                if pid in kernels:
                    try:
                        os.kill(pid, signal.SIGKILL)
                    except ProcessLookupError:
                        pass
        while kernels:                                   # report the kernels that ended
            pid, wait_status = os.waitpid(-1, os.WNOHANG)
            if pid == 0:
                break
            connection = kernels.pop(pid, None)
            if connection is not None:
                try:
                    _send(connection, {"status": os.waitstatus_to_exitcode(wait_status)})
                except OSError:
                    pass
                try:
                    selector.unregister(connection)
                except KeyError:
                    pass
                connection.close()


class KernelZygote:
    """The server of one test process, started on first use; ``kernel_manager()`` makes nbclient use it.

    Example:
        >>> client = NotebookClient(notebook, kernel_manager_class=ZYGOTE.kernel_manager_class())
    """

    def __init__(self, preload: tuple[str, ...] = PRELOAD) -> None:
        """``preload``: the modules the server imports before it forks (the tests of the mechanism pass fewer)."""
        if not isinstance(preload, (tuple, list)) or not preload or \
                not all(isinstance(name, str) and name and "," not in name for name in preload):
            raise ValueError(f"preload must be a non-empty tuple of module names, got {preload!r}")
        self._preload = tuple(preload)
        self._process = None
        self._socket_path: str | None = None

    def _start(self) -> str:
        import atexit
        import subprocess
        import tempfile

        folder = tempfile.mkdtemp(prefix="kernel_zygote_")
        self._socket_path = os.path.join(folder, "server.sock")
        self._process = subprocess.Popen([sys.executable, os.path.abspath(__file__), "serve", self._socket_path,
                                          ",".join(self._preload)])
        atexit.register(self.stop)
        return self._socket_path

    def socket_path(self) -> str:
        """The server's socket; the server is started (and waited for) on first use."""
        import time

        if self._process is None or self._process.poll() is not None:
            self._start()
        deadline = time.monotonic() + 120
        while not os.path.exists(self._socket_path):
            if self._process.poll() is not None:
                raise RuntimeError(f"the kernel server exited with status {self._process.returncode} before listening")
            if time.monotonic() > deadline:
                raise RuntimeError("the kernel server did not listen within 120 s")
            time.sleep(0.05)
        return self._socket_path

    def kernel_manager_class(self):
        """A ``jupyter_client`` AsyncKernelManager subclass whose kernels are forked by this server."""
        from jupyter_client.kernelspec import KernelSpec
        from jupyter_client.manager import AsyncKernelManager

        socket_path = self.socket_path()

        class ForkedKernelManager(AsyncKernelManager):   # nbclient drives an async manager
            @property
            def kernel_spec(self):
                if self._kernel_spec is None:
                    self._kernel_spec = KernelSpec(
                        argv=[sys.executable, os.path.abspath(__file__), "client", socket_path, "-f",
                              "{connection_file}"],
                        display_name="Python 3 (forked)", language="python", interrupt_mode="signal")
                return self._kernel_spec

        return ForkedKernelManager

    def stop(self) -> None:
        """Stop the server (its kernels go with it) and remove its socket's folder."""
        import shutil

        if self._process is not None and self._process.poll() is None:
            self._process.terminate()
            try:
                self._process.wait(timeout=5)
            except Exception:                            # noqa: BLE001
                self._process.kill()
        if self._socket_path is not None:
            shutil.rmtree(os.path.dirname(self._socket_path), ignore_errors=True)


def use_zygote() -> bool:
    """Whether check-mode runs fork their kernels (the default on a CPU machine) or start fresh ones.

    Fresh ones where there is no ``os.fork`` (Windows), where ``PYTORCH_INTRO_FRESH_KERNELS=1`` asks for them, and
    where CUDA is available: a library imported in the server may touch the CUDA driver, and CUDA cannot be used
    again in a process forked after that.
    """
    if os.environ.get(FRESH_KERNELS_VARIABLE, "").strip() in ("1", "true", "yes") or not hasattr(os, "fork"):
        return False
    import torch

    return not torch.cuda.is_available()


if __name__ == "__main__":
    command, path, *rest = sys.argv[1:]
    if command == "serve":
        sys.exit(serve(path, tuple(rest[0].split(",")) if rest else PRELOAD))
    if command == "client":
        sys.exit(client(path, rest))
    sys.exit(f"unknown command {command!r}: expected serve or client")
