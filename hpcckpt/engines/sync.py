"""The baseline engine: ``torch.save`` + fsync under the full commit protocol.

It blocks training for the whole save (device->host copy, serialisation, write,
fsync, commit) and is the reference every faster engine is measured against.
"""
from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from ..state import Flat
from ..store import torchfile
from ..store.names import TORCH, rank_file, rank_record
from .base import Engine, SaveHandle


class SyncEngine(Engine):
    name = "sync"

    def save(self, flat: Flat, step: int, *, final: bool = False) -> SaveHandle:
        """Write, fsync and commit ``step``; main thread, every rank (collective).

        Any error of this rank's write (making the temporary directory included: ENOSPC,
        EIO, EDQUOT...) fails this save only: every rank still takes part in the commit
        exchange, which fails the save everywhere and leaves the previous checkpoint.
        A failed final save (at a stop) is tried once more by the Checkpointer, as a whole
        save, whichever the engine.
        """
        started = time.monotonic()
        handle = SaveHandle(step, final=final)
        tmp = self.temp_path(step)  # collective (a shared token): once per save, whatever fails after
        record, error = self._write(flat, step, tmp)
        try:
            path = self.commit_step(step, tmp, record, error, started, final=final)
        except Exception as exc:
            handle.finish(error=exc)
        else:
            handle.finish(path=path, save_s=time.monotonic() - started)
        self.empty_trash()
        return handle

    def _write(self, flat: Flat, step: int, tmp: Path) -> tuple[dict[str, Any] | None, Exception | None]:
        """(commit record, None) or (None, the error): this rank's file in the save's temp dir."""
        fname = rank_file(self.ranks.rank, TORCH)
        try:
            tmp.mkdir(mode=0o700, parents=True, exist_ok=True)  # as Transaction.temp_dir, without a collective
            written = torchfile.write(tmp / fname, flat.tensors)
            return rank_record(file=fname, fmt=written.pop("format"), meta=flat.meta, tensors=written.pop("tensors"),
                               **written, **self.placement_fields(flat)), None
        except Exception as exc:  # every rank must still take part in the commit exchange
            return None, exc
