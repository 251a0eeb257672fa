"""A trainer's own loop driving the step boundaries: the seam the Lightning and Hugging Face
callbacks share (``Checkpointer.driven``).

The trainer runs its loop; its callback calls ``begin()`` as training begins, ``boundary()``
after each optimizer step, and ``end()`` as training ends. A boundary may save, or stop
(``RequeueExit``, exit 75). A boundary the trainer's evaluation follows at once waits for
its end (``boundary(wait=True)``, then ``evaluated()``): the evaluation draws from the global
RNG, and a run resumed from that boundary would not evaluate again.
"""
from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ..api import Checkpointer


class Driven:
    """The step boundaries of a loop hpcckpt does not run (``Checkpointer.driven``)."""

    def __init__(self, ckpt: Checkpointer, total_steps: int) -> None:
        self._ckpt = ckpt
        self._steps: Iterator[int] | None = ckpt.steps(total_steps)
        self._waiting = False

    @property
    def running(self) -> bool:
        """Whether training goes on (not ended, and steps are left)."""
        return self._steps is not None

    def begin(self) -> bool:
        """Training begins (the restore, the run's start); False when nothing is left to train
        (a re-run of a finished run: it said so, and the run's end is recorded)."""
        return self._next()

    def boundary(self, *, wait: bool = False) -> None:
        """The step just finished: its boundary, now, or (``wait``) after the evaluation that follows."""
        if wait:
            self._waiting = True
            return
        self._next()

    def evaluated(self) -> None:
        """The evaluation ended: the boundary that waited for it runs."""
        if self._waiting:
            self._waiting = False
            self._next()

    def end(self) -> None:
        """Training ended: a boundary still waiting runs; when it ended before the step count
        given (epochs, early stopping), saves in flight are settled and the final state kept,
        as at the end of ``steps()``."""
        self.evaluated()
        if self._steps is not None:
            self._ckpt._finish()
            self._steps = None

    def _next(self) -> bool:
        if self._steps is None:
            return False
        try:
            next(self._steps)  # the boundary: may save, or stop (RequeueExit, exit 75)
        except StopIteration:
            self._steps = None
            return False
        return True
