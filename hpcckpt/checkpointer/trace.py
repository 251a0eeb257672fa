"""``hpcckpt check``'s trace: what a run under the check writes beside its training.

One line per step boundary with a digest of each part of the state (and the step's loss,
``report_loss``), and notes of what the check then reports as not exact: trained state
nothing registered saves, DataLoader iterators the script keeps, an evaluation loader's
worker seed, a resumed epoch numbered with ``enumerate()``. Only the coordinator writes.
"""
from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from ..data import Progress
from ..state import TrainState

log = logging.getLogger("hpcckpt")


class Trace:
    """The trace of one Checkpointer (``path`` None: no check runs, only the warnings are logged)."""

    def __init__(self, path: Path | None, *, coordinator: bool) -> None:
        self.path = path
        self.coordinator = coordinator
        self._loss: str | None = None

    def note(self, record: dict[str, Any]) -> None:
        """Append one record (coordinator, under a check)."""
        if self.path is not None and self.coordinator:
            from ..check import append_trace
            append_trace(self.path, record)

    def report_loss(self, loss: Any) -> None:
        """This step's loss, for the next ``step`` line."""
        if self.path is not None:
            self._loss = float.hex(float(loss))

    def step(self, state: TrainState, step: int) -> None:
        """One line per boundary with a digest of each part of the state (coordinator)."""
        from ..check import append_trace, state_digests
        if self.path is None or not self.coordinator:
            return
        flat = state.capture(step=step, plan=False)
        user_objects = {n: o for n, o in state.objects.items() if n != Progress.NAME}
        digests = {k: v for k, v in state_digests(user_objects, flat).items() if k != Progress.NAME}
        append_trace(self.path, {"step": step, "digests": digests, "loss": self._loss})
        self._loss = None

    def unsaved(self, lines: list[str]) -> None:
        """Log each line of what nothing saves and note it for ``hpcckpt check`` (coordinator)."""
        for line in lines:
            log.warning("hpcckpt: not saved: %s", line)
        if lines:
            self.note({"note": "unsaved", "what": lines})

    def warn_unsaved(self, state: TrainState) -> None:
        """Trained state that nothing registered saves (``coverage.unsaved``), once, on the coordinator."""
        if not self.coordinator:
            return
        from ..coverage import unsaved
        self.unsaved(unsaved({n: o for n, o in state.objects.items() if n != Progress.NAME}))

    def warn_loose_iterators(self, state: TrainState) -> None:
        """At the first step of a run that takes no batch through ``ckpt.batches``/``loop``:
        name the DataLoader iterators the script keeps (``coverage.loose_loader_iterators``)."""
        if not self.coordinator:
            return
        from ..coverage import loose_loader_iterators
        self.unsaved(loose_loader_iterators(state.objects))

    def loader_seed(self, signature: str) -> None:
        """An evaluation loader's workers drew their seed where the uninterrupted run's may not have."""
        self.note({"note": "loader_seed", "what": signature})
