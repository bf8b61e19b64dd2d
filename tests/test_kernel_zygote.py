"""The check-mode tests' forked kernels (tools/kernel_zygote.py): a real kernel, in the environment and folder the
kernel manager gives it, interrupted by nbclient's timeout, and never left behind."""

import os
import signal
import time
from pathlib import Path

import nbformat
import pytest

from tests.processes import alive
from tools.kernel_zygote import KernelZygote
from tools.nbtools import CHECK_KERNELS

pytestmark = pytest.mark.skipif(not hasattr(os, "fork"), reason="kernels are forked only where os.fork exists")


@pytest.fixture(scope="module")
def zygote():
    """The test process's own server, the one its check-mode runs use (started here if none of them ran yet)."""
    return CHECK_KERNELS


def _gone_within(pid: int, seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while alive(pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    return not alive(pid)


def _run(zygote, cells: list[str], tmp_path: Path, timeout_s: int = 60):
    from nbclient import NotebookClient

    notebook = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(source) for source in cells])
    client = NotebookClient(notebook, timeout=timeout_s, kernel_name="python3",
                            kernel_manager_class=zygote.kernel_manager_class(),
                            resources={"metadata": {"path": str(tmp_path)}})
    return client, notebook


def _stdout(cell) -> str:
    return "".join(o.get("text", "") for o in cell.outputs if o.get("output_type") == "stream")


def test_a_forked_kernel_runs_in_the_managers_environment_and_folder(zygote, tmp_path, monkeypatch):
    monkeypatch.setenv("ZYGOTE_TEST_VALUE", "set after the server started")
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    client, notebook = _run(zygote, [
        "import os, sys, torch\nprint(os.environ['ZYGOTE_TEST_VALUE'], os.getcwd(), torch.get_num_threads())",
        "import matplotlib.pyplot as plt\nplt.plot([1, 2]); plt.show()",
        "print(os.getppid() != int(os.environ['JPY_PARENT_PID']), 'torch' in sys.modules)",
    ], tmp_path)
    client.execute()
    assert _stdout(notebook.cells[0]).split() == ["set", "after", "the", "server", "started", str(tmp_path), "1"]
    assert any("image/png" in o.get("data", {}) for o in notebook.cells[1].outputs), "the inline backend draws"
    assert _stdout(notebook.cells[2]).split() == ["True", "True"], "forked from the server, torch imported there"


def test_a_timed_out_cell_is_interrupted_and_its_kernel_does_not_outlive_the_run(zygote, tmp_path):
    from nbclient.exceptions import CellTimeoutError

    client, notebook = _run(zygote, ["import os\nprint(os.getpid())", "import time\ntime.sleep(600)"], tmp_path,
                            timeout_s=2)
    with pytest.raises(CellTimeoutError):
        client.execute()
    pid = int(_stdout(notebook.cells[0]))
    assert _gone_within(pid, 10), "the kernel survived its notebook's end"


def test_a_killed_client_takes_its_kernel_with_it(zygote, tmp_path):
    client, notebook = _run(zygote, ["import os\nprint(os.getpid())"], tmp_path)
    with client.setup_kernel():
        client.execute_cell(notebook.cells[0], 0)
        pid = int(_stdout(notebook.cells[0]))
        os.kill(client.km.provisioner.process.pid, signal.SIGKILL)     # what the manager's kill does, or a crash
        assert _gone_within(pid, 10), "the kernel outlived the client the manager watches"


def test_a_stopped_server_takes_its_kernels_with_it(tmp_path):
    server = KernelZygote(preload=("ipykernel.kernelapp", "ipykernel.ipkernel"))    # what is imported does not matter
    client, notebook = _run(server, ["import os\nprint(os.getpid())"], tmp_path)
    with client.setup_kernel():
        client.execute_cell(notebook.cells[0], 0)
        pid = int(_stdout(notebook.cells[0]))
        server.stop()
        assert _gone_within(pid, 10), "a kernel outlived its server"


@pytest.mark.parametrize("preload", [(), ("torch", "numpy,scipy"), ("",), "torch"])
def test_a_server_refuses_a_preload_that_is_not_module_names(preload):
    with pytest.raises(ValueError, match="preload must be a non-empty tuple of module names"):
        KernelZygote(preload=preload)
