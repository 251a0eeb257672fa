"""Epochs and passes: the step boundaries the loops owe beyond the one after each batch.

A loop may leave a pass of ``ckpt.batches`` at a batch it trained (a ``break`` at
max_steps): that step is counted and its boundary runs at the next boundary point
(``settle_owed``). A pass that ends in the last epoch of ``epochs()`` is the run's end of
training, checkpointed as such (``training_ended``); a pass followed by long per-epoch code
(an evaluation of ``LONG_TAIL_S`` or more) is checkpointed at its end (``pass_ended``). An
epoch that runs no boundary at all (full-batch training) is one step (``epoch_was_a_step``).
"""
from __future__ import annotations

import logging
import time
from types import FrameType
from typing import TYPE_CHECKING

from ..errors import HpcckptError
from ..exitcodes import EXIT_REQUEUE, flush_and_exit
from .loaders import left_by_loop

if TYPE_CHECKING:
    from ..api import Checkpointer
    from ..data import LoaderPosition

log = logging.getLogger("hpcckpt")

# Time between the end of an epoch's training pass and the next pass (its evaluation and other
# per-epoch code) from which the pass's end is checkpointed: a stop that comes in such a stretch
# (a preemption's TERM, whose grace is Slurm's KillWait, 30 s by default, or the site's GraceTime)
# waits for the next step boundary, and a job killed before it comes back from there.
LONG_TAIL_S = 30.0


class Passes:
    """Where the loops of one Checkpointer stand in their epochs and passes."""

    def __init__(self, ckpt: Checkpointer) -> None:
        self._ck = ckpt
        # A step whose boundary is still to run: the loop left a ckpt.batches pass after training its
        # batch ("boundary": counted, its boundary runs at the next boundary point), or an exception
        # left it ("count": counted there, if the script gets there). See left_pass.
        self.owed: str | None = None
        self.last_epoch = False  # the epoch of ckpt.epochs() in progress is its last
        self.tail_step: int | None = None  # the step of the last epoch's end of training, committed
        self.last_step_t: float | None = None
        self.tail_from: float | None = None  # when the last training pass of ckpt.batches ended
        self.tail_s: float | None = None  # how long the code between two passes took, last measured
        self.driven = 0  # step boundaries run and training passes opened: epochs() tells a full-batch epoch by it
        self._epoch_steps_logged = False

    def pass_opened(self) -> None:
        """A training pass begins: the code since the previous one's end is measured (``pass_ended``)."""
        self.last_step_t = time.monotonic()
        if self.tail_from is not None:
            self.tail_s, self.tail_from = self.last_step_t - self.tail_from, None

    def observe_step(self) -> None:
        """One step done: its time, from the previous one's end, to the policy."""
        now = time.monotonic()
        if self.last_step_t is not None:
            self._ck.policy.observe_step(now - self.last_step_t)
        self.last_step_t = now

    def count_step(self) -> None:
        """One more step done, without its boundary (``left_pass``)."""
        self.observe_step()
        self._ck.step += 1
        self._ck._trace.step(self._ck.state, self._ck.step)

    def epochs_left(self, frame: FrameType, total: int) -> None:
        """The loop over ``epochs()`` was left inside an epoch (its generator closed there). By a
        ``break`` or ``return`` (early stopping): the run ended there, as at the last epoch's end
        (``_finish``: the final checkpoint, with nothing left for a re-run, and the guard of the
        code after the loop). By an exception: nothing (the script fails as it would have)."""
        ck = self._ck
        if ck._closed or not left_by_loop(frame):
            return
        try:
            if self.owed == "count":
                self.count_step()
            self.owed = None
            self.last_epoch = False
            ck.progress.epoch = total
            ck._finish()
            ck.close()
        except SystemExit as exc:  # a stop signal that came before the break: requeued by the guard
            # This runs while the generator is closed, where an exception would only be printed.
            ck.close()
            flush_and_exit(exc.code if isinstance(exc.code, int) else EXIT_REQUEUE)
        except Exception:  # noqa: BLE001 - printed and ignored where it was raised (a closing generator)
            log.exception("hpcckpt: ending the run after the loop left ckpt.epochs() failed")

    def epoch_was_a_step(self, i: int) -> None:
        """An epoch that ran no step boundary and opened no ``ckpt.batches`` pass (full-batch
        training: one optimizer step an epoch, as pytorch/examples' gcn and gat) is one step,
        and its end the step's boundary: periodic saves count epochs, and a stop (signal,
        time limit, maintenance) is taken there with the next epoch as the resume point.
        Before, such a loop never reached a boundary: a stop was recorded and never taken,
        and the job was killed with nothing saved since it started."""
        if not self._epoch_steps_logged:
            self._epoch_steps_logged = True
            log.info("hpcckpt: epoch %d ran no step of ckpt.batches/loop/step_done: each epoch counts as one "
                     "step (saves and stops at epoch ends)", i)
        self._ck.progress.epoch = i + 1  # what a save here resumes at
        self._ck.step_done()

    def pass_ended(self) -> None:
        """A training pass of ``ckpt.batches`` has ended. When the code between the previous
        two passes (an evaluation, per-epoch work) took ``LONG_TAIL_S`` or more, this state is
        checkpointed now (every rank, when any measured so): a stop that comes during that code
        is only taken at the next step boundary, and a job killed before it would lose the
        epoch (with no periodic saves, the run). A resume from here runs the epoch's code again
        from its start, as after a stop at the epoch's last batch. In the last epoch of
        ``epochs()`` the run's end of training is checkpointed (``training_ended``)."""
        ck = self._ck
        self.tail_from = time.monotonic()
        if self.last_epoch:
            self.training_ended()
            return
        long_tail = self.tail_s is not None and self.tail_s >= LONG_TAIL_S
        if not ck.ranks.max(int(long_tail)):
            return
        if ck._saves.holds(ck.step):
            return  # a periodic save of this step already
        log.info("hpcckpt: checkpointing the end of this epoch's training (step %d): the code between epochs "
                 "took %.0fs last time, and a stop during it waits for the next step", ck.step, self.tail_s or 0)
        ck.save()

    def training_ended(self) -> None:
        """A training pass of the last epoch of ``epochs()`` ended (or the loop left it, a break at
        max_steps): this state, marked finished, is the run's final checkpoint. A re-run of the
        finished run (the requeue of a stop in the code after the loop, or the script started
        again) resumes here, trains nothing and runs the last epoch's code after its training
        again (its evaluation: what the code after the loop uses is set as in the uninterrupted
        run), then the code after the loop. A checkpoint of this step (a periodic one, or the one
        this run resumed from) is the same place already."""
        ck = self._ck
        if ck._restore.already_finished:
            return
        if ck._saves.holds(ck.step):
            self.tail_step = ck.step
            return
        ck.progress.finished = True
        try:
            ck._saves.save_final(ck.step)
            self.tail_step = ck.step
        except (HpcckptError, OSError) as exc:
            log.error("hpcckpt: the checkpoint of the end of training (step %d) failed: %s", ck.step, exc)
        finally:
            ck.progress.finished = False

    def left_pass(self, pos: LoaderPosition, *, trained: bool, by_loop: bool) -> None:
        """The loop left a pass of ``ckpt.batches`` at a batch it had taken (the pass's generator
        was closed there, so that batch's boundary, which runs when the loop asks for the next
        batch, did not run). The pass is over (a resume of it yields nothing). When the batch was
        trained (a registered optimizer stepped, or a registered module accumulated gradients,
        since it was handed out; without those, it counts as trained) it is a step: by a
        ``break``/``return`` (a loop that ends at max_steps mid-epoch) it is counted now, so
        that the code after the loop sees ``ckpt.step`` right and the end of training is
        checkpointed with its true number, and its boundary (stop, periodic save) runs at the
        next boundary point (the epoch's end in ``epochs()``, or the next pass); by an exception
        it is counted there, if the script gets there."""
        pos.leave("left")
        try:
            if trained and not by_loop:
                self.owed = "count"
                return
            if trained:
                self.count_step()
                self.owed = "boundary"
            if by_loop:
                self.pass_ended()
        except Exception:  # noqa: BLE001 - printed and ignored where it was raised (a closing generator)
            log.exception("hpcckpt: the step of the batch the loop left ckpt.batches at could not be completed")

    def settle_owed(self, *, epoch_done: int | None = None) -> None:
        """The boundary of a step the loop left ``ckpt.batches`` at (``left_pass``), at the next
        boundary point: the end of the epoch's code (``epoch_done``: a save here resumes at the
        next epoch) or the next pass. Not saved again where this step is already."""
        owed, self.owed = self.owed, None
        if owed is None:
            return
        if owed == "count":
            self.count_step()
        if epoch_done is not None:
            self._ck.progress.epoch = epoch_done + 1
        self._ck._boundary(trace=False, periodic=not self._ck._saves.holds(self._ck.step))
