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
from .fsio import write_all as fsio_write_all


def _tags(peers: list[int]) -> list[int]:
    """Each transfer's tag: how many transfers to (or from) the same peer come before it."""
    seen: dict[int, int] = {}
    out = []
    for p in peers:
        out.append(seen.get(p, 0))
        seen[p] = out[-1] + 1
    return out


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

    def exchange_files(self, sends: list[tuple[int, str, int]], recvs: list[tuple[int, str, int]],
                       *, chunk_bytes: int = 64 << 20) -> None:
        """Send and receive whole files point to point over the group (multi-level checkpoints).

        ``sends``: (destination rank, path, bytes); ``recvs``: (source rank, path to create,
        bytes). Both sides know each file's size; a file goes in ``chunk_bytes`` pieces, every
        rank's pieces of one round in flight together, so no pairing order can deadlock. The
        k-th file between two ranks in one direction is matched by its tag k. Received files
        are fsynced. Collective over the ranks taking part (each pairs its sends with the
        peer's receives).
        """
        import math
        import os

        group = self._comm()
        if group is None:
            if sends or recvs:
                raise HpcckptError("a file transfer between ranks needs torch.distributed with more than one rank")
            return
        n_chunks = [max(1, math.ceil(size / chunk_bytes)) for _, _, size in sends + recvs]
        send_tags, recv_tags = _tags([d for d, _, _ in sends]), _tags([s for s, _, _ in recvs])
        src_fds = [os.open(p, os.O_RDONLY) for _, p, _ in sends]
        dst_fds = [os.open(p, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600) for _, p, _ in recvs]
        # One buffer per transfer, reused piece after piece (a round's pieces are all done
        # before the next round fills them): no allocation or copy per piece.
        sizes = [size for _, _, size in sends + recvs]
        bufs = [torch.empty(max(1, min(chunk_bytes, size)), dtype=torch.uint8) for size in sizes]
        try:
            for c in range(max(n_chunks, default=0)):
                pending: list[tuple[Any, int | None, int]] = []
                for i, (dst, _, size) in enumerate(sends):
                    if c < n_chunks[i]:
                        n = min(chunk_bytes, size - c * chunk_bytes)
                        view = bufs[i].numpy().data[:max(n, 1)]
                        if n > 0 and os.preadv(src_fds[i], [view], c * chunk_bytes) != n:
                            raise HpcckptError(f"{sends[i][1]} is shorter than {size} bytes")
                        pending.append((dist.isend(bufs[i][:max(n, 1)], dst, group=group, tag=send_tags[i]), None, 0))
                for j, (src, _, size) in enumerate(recvs):
                    k = len(sends) + j
                    if c < n_chunks[k]:
                        n = min(chunk_bytes, size - c * chunk_bytes)
                        pending.append((dist.irecv(bufs[k][:max(n, 1)], src, group=group, tag=recv_tags[j]),
                                        k if n > 0 else None, n))
                for work, into, n in pending:
                    work.wait()
                    if into is not None:
                        fsio_write_all(dst_fds[into - len(sends)], bufs[into].numpy().data[:n])
            for fd in dst_fds:
                os.fsync(fd)
        finally:
            for fd in src_fds + dst_fds:
                os.close(fd)

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
