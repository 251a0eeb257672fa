"""Which GPU a restored CUDA process lands on.

At dump time the image manifest records the GPUs the job saw (index, UUID, model).
At restore the driver looks a checkpointed process's GPUs up by UUID. On the same
GPUs nothing is needed. On a new allocation the UUIDs differ: each recorded GPU is
paired with the GPU at the same CUDA index here (the job's device 0 stays its device
0), which must be the same model; the driver (>= 580) takes the pairs in
cuCheckpointProcessRestore. Every recorded GPU is paired, as the driver requires.
"""
from __future__ import annotations

from typing import Any

from ..errors import CudaCheckpointError
from .driver import MIN_REMAP_TEXT, Gpu


def plan(recorded: list[dict[str, Any]], here: list[Gpu], *, can_remap: bool) -> list[tuple[str, str]] | None:
    """None when the recorded GPUs are all here; else (old UUID, new UUID) pairs.

    Raises CudaCheckpointError, saying what differs, when this node cannot take the job."""
    if not recorded:
        return None
    uuids_here = {g.uuid for g in here}
    if all(r["uuid"] in uuids_here for r in recorded):
        return None
    if len(here) < len(recorded):
        raise CudaCheckpointError(f"the image was taken with {len(recorded)} GPU(s); this allocation has "
                                  f"{len(here)}: request the same GPU count (e.g. --gres=gpu:{len(recorded)})")
    pairs = []
    for old in recorded:
        new = here[int(old["index"])]
        if new.name != old["name"]:
            raise CudaCheckpointError(f"GPU {old['index']} was a {old['name']} at dump time and is a {new.name} "
                                      "here; a CUDA checkpoint restores only onto the same GPU model: "
                                      "constrain the job to that model (e.g. --constraint or a gres type)")
        pairs.append((str(old["uuid"]), new.uuid))
    if not can_remap:
        raise CudaCheckpointError(f"this allocation has other GPUs than the image ({', '.join(p[0] for p in pairs)} "
                                  f"are not here) and restoring onto other GPUs needs {MIN_REMAP_TEXT}")
    return pairs
