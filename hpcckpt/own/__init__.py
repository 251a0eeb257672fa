"""Scripts that keep their own checkpoints: the third way in, beside the ``Checkpointer`` and
CRIU mode.

The script is run unchanged under ``hpcckpt run --mode own`` (``hpcckpt template own``), which
gives it one notice at the lead before the deadline, requeues it when it exits 75 after its
own save, and keeps honest records (``hpcckpt.own.supervise``). A script that wants one line
more can ask and say, as submitit's ``checkpoint()``, Lightning's requeue signal and the
Hugging Face Trainer's ``control.should_save`` let it::

    import hpcckpt.own as own

    for step, batch in enumerate(loader, start=start_step):
        train_step(batch)
        if own.should_stop():            # the notice came (the lead before the deadline)
            save_checkpoint(step, path)  # the script's own save
            own.saved(step, path)        # so `hpcckpt history` counts what a stop lost
            sys.exit(75)                 # "requeue me"

``should_stop()`` is cheap (a flag and at most one ``stat``) and never raises; outside the
supervisor it is False until a TERM arrives. ``saved()`` does nothing outside it.

For the Hugging Face ``Trainer``, ``hf_callback()`` is the same as a callback: at the notice it
asks the Trainer for its own checkpoint (``control.should_save``), reports it, and exits 75
once it is written::

    trainer = Trainer(..., callbacks=[own.hf_callback()])
    trainer.train(resume_from_checkpoint=last_checkpoint)   # the script's own resume
"""
from __future__ import annotations

import os
import signal
import threading
from pathlib import Path
from typing import Any

__all__ = ["hf_callback", "saved", "should_stop"]

_flag = threading.Event()
_installed = False


def _listen() -> None:
    """Once: a flag handler for the notice signal (and TERM) where the script has none of its own."""
    global _installed
    if _installed or threading.current_thread() is not threading.main_thread():
        return
    _installed = True
    names = {"TERM"}
    notice = os.environ.get("HPCCKPT_NOTICE", "")
    if notice and not notice.startswith("file "):
        names.add(notice.removeprefix("SIG"))
    for name in names:
        sig = getattr(signal, f"SIG{name}", None)
        if sig is not None and signal.getsignal(sig) in (signal.SIG_DFL, signal.SIG_IGN, None):
            signal.signal(sig, lambda _s, _f: _flag.set())


def should_stop() -> bool:
    """True once the stop's notice has come: save, call ``saved()``, exit 75."""
    _listen()
    if _flag.is_set():
        return True
    path = os.environ.get("HPCCKPT_NOTICE_FILE")
    if path and os.path.exists(path):
        _flag.set()
    return _flag.is_set()


def saved(step: int | None, path: str | os.PathLike[str] | None = None, **meta: Any) -> None:
    """Say that the script's own checkpoint of ``step`` is durable at ``path``: the records then
    count what a later stop loses from here. JSON-able ``meta`` is kept with it."""
    root = os.environ.get("HPCCKPT_DIR")
    if not root:
        return
    from ..lifecycle.ledger import Ledger

    Ledger(Path(root)).append("saved", step=step, path=None if path is None else str(path), **meta)


def hf_callback() -> Any:
    """A ``transformers.TrainerCallback``: at the notice, the Trainer saves its own checkpoint
    at the end of the step, ``saved()`` reports it, and the process exits 75."""
    from transformers import TrainerCallback

    class _StopAndSave(TrainerCallback):
        stopping = False

        def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> Any:
            if should_stop():
                self.stopping = True
                control.should_save = True
            return control

        def on_save(self, args: Any, state: Any, control: Any, **kwargs: Any) -> Any:
            if self.stopping:
                step = int(state.global_step)
                saved(step, os.path.join(str(args.output_dir), f"checkpoint-{step}"))
                raise SystemExit(75)
            return control

    return _StopAndSave()
