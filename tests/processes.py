"""A helper the process tests share: whether a process is still running."""
from __future__ import annotations

import os
from pathlib import Path


def alive(pid: int) -> bool:
    """Whether process ``pid`` runs: it exists and is not a zombie (exited, not yet reaped by its parent; Linux's
    /proc tells, elsewhere an existing process counts as running)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    state = Path(f"/proc/{pid}/stat")
    return not (state.exists() and state.read_text().split()[2] == "Z")
