"""A storage counter written apart from the course's tracker: the second, independent measurement of ``validate_hf``.

``StorageCounter`` is a ``TorchDispatchMode`` that follows every storage an op returns with a weakref; on the
transformers grid it agrees with torch's ``MemTracker`` to the byte wherever MemTracker runs, and it also runs
where torch 2.13's MemTracker refuses (frozen parameters: LoRA; a module called twice: accumulation).
"""

from __future__ import annotations

import weakref
from typing import Any


def _torch():  # noqa: ANN202 - imported lazily
    import torch

    return torch


class StorageCounter:
    """Bytes of live tensor storage on the CPU, followed op by op (a ``TorchDispatchMode``), with a peak.

    Written apart from ``utils.measure_memory``: each storage an op returns is followed by a weakref
    (``weakref.finalize``) and counted once, whatever views of it exist; a storage an op received as an
    input (a view, an in-place result) is not new. ``follow`` adds tensors that exist already.

    Example:
        >>> with StorageCounter() as counter:
        ...     counter.follow(model.parameters())
        ...     step()
        >>> counter.peak_bytes
    """

    def __init__(self, trace: bool = False) -> None:
        torch = _torch()
        from torch.utils._python_dispatch import TorchDispatchMode

        counter = self

        class _Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN202
                out = func(*args, **(kwargs or {}))
                counter._seen(func, args, kwargs, out)
                return out

        self._mode = _Mode()
        self._torch = torch
        self.live: dict[int, int] = {}
        self.current = 0
        self.peak_bytes = 0
        self.phase = "start"
        self.peak_phase = "start"
        self.marks: dict[str, int] = {}
        self.events: list[tuple[str, int, str]] | None = [] if trace else None
        self._finalizers: list[Any] = []

    def _add(self, storage: Any, label: str) -> None:
        key = storage._cdata
        if key in self.live or storage.nbytes() == 0:
            return
        self.live[key] = storage.nbytes()
        self.current += storage.nbytes()
        if self.events is not None:
            self.events.append((self.phase, storage.nbytes(), label))
        if self.current > self.peak_bytes:
            self.peak_bytes, self.peak_phase = self.current, self.phase
        self._finalizers.append(weakref.finalize(storage, self._free, key))

    def _free(self, key: int) -> None:
        nbytes = self.live.pop(key, None)
        if nbytes is not None:
            self.current -= nbytes
            if self.events is not None:
                self.events.append((self.phase, -nbytes, "free"))

    def _seen(self, func: Any, args: Any, kwargs: Any, out: Any) -> None:
        torch = self._torch
        from torch.utils._pytree import tree_flatten

        inputs = {t.untyped_storage()._cdata for t in tree_flatten((args, kwargs))[0]
                  if isinstance(t, torch.Tensor) and t.device.type == "cpu"}
        fresh = func is torch.ops.aten.lift_fresh.default
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor) and t.device.type == "cpu" and t.layout == torch.strided:
                storage = t.untyped_storage()
                if storage._cdata in inputs and not fresh:
                    continue
                self._add(storage, str(func))

    def follow(self, tensors: Any) -> None:
        """Count tensors that exist already (parameters, optimizer state, the batch)."""
        torch = self._torch
        from torch.utils._pytree import tree_flatten

        for t in tree_flatten(list(tensors))[0]:
            if isinstance(t, torch.Tensor):
                self._add(t.untyped_storage(), "existing")

    def mark(self, phase: str) -> None:
        """Start a named phase (the bytes alive when each phase ends are kept in ``marks``)."""
        self.marks[self.phase] = self.current
        self.phase = phase

    def __enter__(self) -> "StorageCounter":
        self._mode.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        self._mode.__exit__(*exc)
        self.marks[self.phase] = self.current
        for finalizer in self._finalizers:
            finalizer.detach()
