"""Data parallelism in the replay: FSDP's all-gathers and reshards, ZeRO-2/FSDP's reduce-scatters."""

from __future__ import annotations

import math

from .replay import _Buf, _shard_numel


def unit_of(name: str) -> int:
    """The FSDP unit (block index, or -1 for the root: embeddings, final norm, head) a parameter is in."""
    parts = name.split(".")
    for part, index in zip(parts, parts[1:]):   # blocks.3. / layers.3. / model.layers.3. / transformer.h.3.
        if part in ("blocks", "layers", "h") and index.isdigit():
            return int(index)
    return -1


class _DataParallel:
    """Mixin of ``_Step``: what each rank holds and gathers, phase by phase."""

    def unit_of(self, name: str) -> int:
        """The FSDP unit a parameter is in (``unit_of``)."""
        return unit_of(name)

    def gather(self, unit: int) -> None:
        """FSDP all-gathers a unit's parameters (every parameter, frozen ones too) before using them."""
        if self.setup.strategy != "fsdp" or unit in self.gathered or not -1 <= unit < self.model.num_layers:
            return
        size = sum(leaf.numel * leaf.item for leaf in self.leaves.values() if self.unit_of(leaf.name) == unit)
        self.gathered[unit] = self._alloc(size, "comm_buffers", f"all-gathered unit {unit}")
        self.incref(self.gathered[unit])

    def reshard(self, unit: int) -> None:
        buf = self.gathered.pop(unit, None)
        if buf is not None:
            self.decref(buf)

    def reduce_scatter(self, unit: int) -> None:
        """A unit's whole gradients become this rank's 1/N shard (added to the shard from earlier micro-batches)."""
        for leaf in self.leaves.values():
            if self.unit_of(leaf.name) != unit or leaf.name not in self.pending_grads:
                continue
            shard = _shard_numel(leaf.shape, self.setup.ranks) * leaf.item if self.setup.strategy == "fsdp" else \
                math.ceil(leaf.numel * leaf.item / self.setup.ranks)   # ZeRO-2: a flat 1/N partition
            for buf in self.pending_grads.pop(leaf.name):
                if leaf.grad is None:
                    leaf.grad = self._alloc(shard, "gradients", f"{leaf.name} grad shard")
                    self.incref(leaf.grad)
                else:
                    self.decref(self._incref_new(shard, f"{leaf.name} reduced shard"))
                self.decref(buf)

    def _incref_new(self, nbytes: int, label: str) -> _Buf:
        buf = self._alloc(nbytes, "temporaries", label)
        self.incref(buf)
        return buf

    def set_phase(self, phase: str) -> None:
        super().set_phase(phase)
        if self.setup.strategy not in ("zero2", "fsdp") or "." not in phase:
            return
        where = phase.split(".", 1)[1]
        last = self.model.num_layers - 1
        if where == "embed":
            self.gather(-1)
            self.gather(0)
        elif where[0] == "f":                    # forward of block i: i and the next are gathered, i - 1 resharded
            i = int(where[1:])
            self.gather(i)
            self.gather(i + 1)
            self.reshard(i - 1)
        elif where == "head":
            self.reshard(last)
        elif where == "bloss":
            self.gather(last)
        elif where[0] == "b":                    # backward of block i: block i + 1 is done
            i = int(where[1:])
            self.gather(i)
            self.gather(i - 1)
            self.reshard(i + 1)
            self.reduce_scatter(i + 1 if i < last else -1)

    def after_backward(self) -> None:
        if self.setup.strategy in ("zero2", "fsdp"):
            for unit in (0, -1):
                self.reshard(unit)
                self.reduce_scatter(unit)
