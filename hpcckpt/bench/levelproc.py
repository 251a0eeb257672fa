"""One rank of ``hpcckpt bench --levels``' partner copy: files sent rank to rank over gloo.

Started twice by ``hpcckpt.bench.levels`` (2 local processes, gloo over 127.0.0.1)::

    python -m hpcckpt.bench.levelproc --rank R --port P --spec SPEC.json --out RESULT.json

``SPEC.json``: ``{"files": [[path, bytes], ...] (one rank file per rank, in rank order),
"into": [dir of rank 0, dir of rank 1], "rounds": K}``. Each rank opens the same process
group and ``Ranks`` as a Checkpointer does, then per round, in the order that alternates
by round, times two transfers with ``Ranks.exchange_files`` (the levels' partner copy:
64 MiB pieces, received files fsynced), each started after a barrier:

- ``one_way``: rank 0 sends every file of the set to rank 1;
- ``both_ways``: each rank sends its own file to the other and receives the other's at
  once, as the partner copies of a job on 2 nodes do.

Received files go into the rank's ``into`` directory and are removed between transfers
(untimed). ``RESULT.json`` (rank 0's is read) gets per round the slowest rank's seconds
of each transfer and the bytes each moved in all.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

from .rankproc import leave


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m hpcckpt.bench.levelproc")
    p.add_argument("--rank", type=int, choices=(0, 1), required=True)
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--spec", type=Path, required=True)
    p.add_argument("--out", type=Path, required=True)
    return p.parse_args(argv)


def transfers(kind: str, rank: int, files: list[tuple[str, int]], into: list[str]
              ) -> tuple[list[tuple[int, str, int]], list[tuple[int, str, int]]]:
    """(sends, receives) of ``rank`` for the transfer ``kind`` (``one_way`` or ``both_ways``)."""
    other = 1 - rank

    def dest(path: str) -> str:
        return str(Path(into[rank]) / Path(path).name)

    if kind == "one_way":
        if rank == 0:
            return [(1, p, n) for p, n in files], []
        return [], [(0, dest(p), n) for p, n in files]
    if kind == "both_ways":
        mine, theirs = files[rank], files[other]
        return [(other, mine[0], mine[1])], [(other, dest(theirs[0]), theirs[1])]
    raise ValueError(f"unknown transfer {kind!r}")


def _clear(into: str) -> None:
    for entry in os.scandir(into):
        if entry.is_file(follow_symlinks=False):
            os.unlink(entry.path)


def bench(rank: int, spec: dict[str, Any]) -> dict[str, Any]:
    from ..ranks import Ranks

    files = [(str(p), int(n)) for p, n in spec["files"]]
    into = [str(d) for d in spec["into"]]
    Path(into[rank]).mkdir(parents=True, exist_ok=True)
    ranks = Ranks()
    out: dict[str, list[float]] = {"one_way_s": [], "both_ways_s": []}
    moved = {"one_way": sum(n for _, n in files), "both_ways": files[0][1] + files[1][1]}
    try:
        # warm-up, untimed: the group's pairs connected, the code paths loaded
        warm = Path(into[rank]) / "warm"
        if rank == 0:
            warm.write_bytes(b"x" * 4096)
        ranks.exchange_files([(1, str(warm), 4096)] if rank == 0 else [],
                             [(0, str(warm), 4096)] if rank == 1 else [])
        _clear(into[rank])
        for k in range(int(spec["rounds"])):
            order = ("one_way", "both_ways") if k % 2 == 0 else ("both_ways", "one_way")
            for kind in order:
                sends, recvs = transfers(kind, rank, files, into)
                ranks.max(0)  # both ranks start together
                t0 = time.perf_counter()
                ranks.exchange_files(sends, recvs)
                took = time.perf_counter() - t0
                out[f"{kind}_s"].append(max(float(t) for t in ranks.gather_json(took)))
                _clear(into[rank])
                ranks.max(0)  # the files are gone on both sides before the next transfer
    finally:
        ranks.close()
    return {"rank": rank, **out, "bytes": moved, "rounds": int(spec["rounds"])}


def main(argv: list[str] | None = None) -> int:
    a = parse(argv)
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{a.port}", rank=a.rank, world_size=2)
    leave(a.out, bench(a.rank, json.loads(a.spec.read_text())))
    return 0


if __name__ == "__main__":
    sys.exit(main())
