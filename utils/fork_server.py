"""The fork server behind notebooks 13's and 14's CPU ranks: one fresh Python imports what every rank needs once,
then forks the ranks from itself and waits for them (each a copy with the imports done, no thread started yet).

Introduced in notebook 13 (``utils.model_parallel``), used by notebook 14 too (``utils.expert_parallel_ranks``).
"""
from __future__ import annotations

import importlib
import json
import os
import signal
import sys
import traceback
from pathlib import Path
from typing import Callable, Sequence


def serve_ranks(world_size: int, out: Path | str, argv: Sequence[str], rank_main: Callable[[Sequence[str]], object],
                preload: Sequence[str] = ()) -> int:
    """Import ``preload`` once, fork ``world_size`` ranks that each run ``rank_main(argv)``, wait for them all.

    Why: each rank started as a fresh Python would import torch and its distributed modules again (seconds of CPU
    per rank); forked from one server, they pay once. Each child is told its rank as torchrun tells it (``RANK``,
    ``LOCAL_RANK``; the rest of the environment is the server's) and writes its output to ``<out>/rank<r>.log``.
    The first rank that fails is written to ``<out>/failure.json`` and the others are killed at once (they would
    wait for it until their collectives time out).

    Args:
        world_size: ranks to fork (>= 1).
        out: an existing folder for the ranks' logs and the failure record.
        argv: the command-line arguments handed to ``rank_main``.
        rank_main: a rank's entry point (the module's ``main``).
        preload: modules to import in the server before forking.

    Returns:
        The server's exit status: 0 when every rank succeeded, else 1.

    Example:
        >>> serve_ranks(4, "build/ranks", ["--out=build/ranks"], main, preload=("torch.distributed.fsdp",))
    """
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be an int >= 1, got {world_size!r}")
    for module in preload:
        importlib.import_module(module)
    out = Path(out)
    children: dict[int, int] = {}
    sys.stdout.flush()
    sys.stderr.flush()
    for rank in range(world_size):
        pid = os.fork()
        if pid == 0:                                     # the rank: a copy of the server, imports done
            code = 1
            try:
                log = os.open(out / f"rank{rank}.log", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
                os.dup2(log, 1)
                os.dup2(log, 2)
                os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank))
                rank_main(argv)
                code = 0
            except SystemExit as error:
                code = error.code if isinstance(error.code, int) else 1
            except BaseException:                        # noqa: BLE001  (its traceback goes to its log)
                traceback.print_exc()
            finally:
                sys.stdout.flush()
                sys.stderr.flush()
                os._exit(code)                           # no interpreter teardown: the record is written
        children[pid] = rank
    failed = False
    while children:
        pid, status = os.wait()
        rank, code = children.pop(pid), os.waitstatus_to_exitcode(status)
        if code != 0 and not failed:
            failed = True
            (out / "failure.json").write_text(json.dumps({"rank": rank, "code": code}))
            for other in children:
                os.kill(other, signal.SIGKILL)
    return 1 if failed else 0
