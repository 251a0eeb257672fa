"""Agreement between ranks: stop step, save outcome, shared names.

With ``torch.distributed`` initialised, a dedicated gloo group carries the small
control messages (a flag at each step boundary, JSON records when a checkpoint
commits), so checkpoint traffic never queues behind NCCL and works on CPU jobs.
Without it, every call is local.
"""
from __future__ import annotations

import json
import secrets
from typing import Any

import torch
import torch.distributed as dist

from .errors import HpcckptError


class Ranks:
    def __init__(self) -> None:
        self.distributed = dist.is_available() and dist.is_initialized()
        self.rank = dist.get_rank() if self.distributed else 0
        self.world = dist.get_world_size() if self.distributed else 1
        self._group = dist.new_group(backend="gloo") if self.distributed and self.world > 1 else None
        # A second group for collectives issued from a background thread (async commits):
        # two threads must never interleave collectives on one group.
        self._bg_group = dist.new_group(backend="gloo") if self._group is not None else None
        self._closed = False

    def _comm(self) -> Any:
        """The group to talk over (None: a single rank, every call is local)."""
        if self._closed and self.world > 1:
            raise HpcckptError(f"rank {self.rank}: hpcckpt's rank agreement was used after Checkpointer.close() "
                               "destroyed its groups; keep the Checkpointer open while training")
        return self._group

    def background(self) -> Ranks:
        """The same ranks, talking over the background group (use from one background thread)."""
        view = object.__new__(Ranks)
        view.__dict__.update(self.__dict__)
        view._group = self._bg_group
        return view

    @property
    def is_coordinator(self) -> bool:
        return self.rank == 0

    def max(self, flag: int) -> int:
        """Maximum of ``flag`` over all ranks (the agreed stop reason code; 1 if any rank says 1)."""
        group = self._comm()
        if group is None:
            return flag
        t = torch.tensor([flag], dtype=torch.int64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
        return int(t.item())

    def all(self, flag: bool) -> bool:
        return self.max(0 if flag else 1) == 0

    def gather_json(self, obj: Any) -> list[Any]:
        """Every rank's ``obj`` (JSON-serialisable), on every rank."""
        group = self._comm()
        if group is None:
            return [obj]
        out: list[Any] = [None] * self.world
        dist.all_gather_object(out, json.dumps(obj), group=group)
        return [json.loads(s) for s in out]

    def broadcast_json(self, obj: Any) -> Any:
        """The coordinator's ``obj`` on every rank."""
        group = self._comm()
        if group is None:
            return obj
        box = [json.dumps(obj) if self.is_coordinator else None]
        dist.broadcast_object_list(box, src=0, group=group)
        return json.loads(box[0])  # type: ignore[arg-type]  # the broadcast filled box[0] with a str

    def close(self) -> None:
        """Destroy the groups made here, while the interpreter is fully alive.

        A gloo group still referenced at interpreter exit is torn down during
        finalization, when its threads can no longer take the GIL; that aborts the
        process ("terminate called without an active exception") about one exit in
        ten on the development VM. Idempotent; the user's own groups are untouched.
        Collectives after close raise (rather than silently acting alone).
        """
        self._closed = True
        for name in ("_bg_group", "_group"):
            group = getattr(self, name)
            setattr(self, name, None)
            if group is not None and dist.is_available() and dist.is_initialized():
                dist.destroy_process_group(group)

    def token(self) -> str:
        """A random token shared by all ranks (names a save's temporary directory)."""
        return str(self.broadcast_json(secrets.token_hex(6)))
