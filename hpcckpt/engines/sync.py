"""The baseline engine: ``torch.save`` + fsync under the full commit protocol.

It blocks training for the whole save (device->host copy, serialisation, write,
fsync, commit) and is the reference every faster engine is measured against.
"""
from __future__ import annotations

import time

from ..state import Flat
from ..store import torchfile
from .base import Engine, SaveHandle


class SyncEngine(Engine):
    name = "sync"

    def save(self, flat: Flat, step: int, *, final: bool = False) -> SaveHandle:
        started = time.monotonic()
        handle = SaveHandle(step)
        tmp = self.temp_dir(step)
        fname = f"rank-{self.ranks.rank}.pt"
        record = None
        error: BaseException | None = None
        try:
            record = {"file": fname, "meta": flat.meta, **torchfile.write(tmp / fname, flat.tensors),
                      **self.placement_fields(flat)}
        except Exception as exc:  # every rank must still take part in the commit exchange
            error = exc
        try:
            path = self.commit_step(step, tmp, record, error, started)
        except Exception as exc:
            handle.finish(error=exc)
        else:
            handle.finish(path=path, save_s=time.monotonic() - started)
        return handle
