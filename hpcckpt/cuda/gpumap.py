"""Which GPUs a CUDA job used, and which GPU each lands on when it is restored.

At dump time (before the lock: a checkpointed process holds no GPU files) the image
manifest records the GPUs the job's CUDA processes USE, not every GPU the node shows:
the /dev/nvidiaN device files they have mapped (else, open), each minor N turned into
its UUID and model by /proc/driver/nvidia/gpus/*/information, and kept with its CUDA
index as the job sees it. Where that cannot be read (no /proc/driver/nvidia, MIG),
every visible GPU is recorded instead, and the manifest says so.

At restore the driver looks a checkpointed process's GPUs up by UUID. When all of them
are here nothing is needed. Otherwise (driver >= 580) cuCheckpointProcessRestore takes
(old UUID, new UUID) pairs that "must contain every checkpointed GPU" (cuda.h): a GPU
still here keeps its UUID (an identity pair), and the rest are paired in CUDA-index
order with the free GPUs here of the same model (the job's first H100 that moved goes
to the first free H100 here). Too few GPUs of a model is a clear error, never a guess.
"""
from __future__ import annotations

import re
from collections import defaultdict
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from ..errors import CudaCheckpointError
from ..proc.tree import nvidia_files
from .driver import MIN_REMAP_TEXT, Gpu

NVIDIA_GPUS = Path("/proc/driver/nvidia/gpus")
_MINOR = re.compile(r"^/dev/nvidia(\d+)$")


def driver_gpus(root: Path = NVIDIA_GPUS) -> dict[int, dict[str, str]]:
    """Device minor -> {"uuid", "name", "bus"} from the driver's /proc files (empty if none)."""
    out: dict[int, dict[str, str]] = {}
    try:
        infos = sorted(root.glob("*/information"))
    except OSError:
        return out
    for info in infos:
        try:
            fields = {k.strip(): v.strip() for k, _, v in
                      (line.partition(":") for line in info.read_text(errors="replace").splitlines())}
            minor = int(fields["Device Minor"])
        except (OSError, KeyError, ValueError):
            continue
        out[minor] = {"uuid": fields.get("GPU UUID", ""), "name": fields.get("Model", ""), "bus": info.parent.name}
    return out


def minors(pid: int) -> tuple[set[int], set[int]]:
    """(mapped, open) /dev/nvidiaN minors of ``pid`` (nvidiactl, nvidia-uvm are not GPUs)."""
    mapped, opened = nvidia_files(pid)
    return ({int(m.group(1)) for m in map(_MINOR.match, mapped) if m},
            {int(m.group(1)) for m in map(_MINOR.match, opened) if m})


def job_gpus(pids: Iterable[int], visible: list[Gpu], *, log: Callable[[str], None] = lambda _m: None,
             minors_of: Callable[[int], tuple[set[int], set[int]]] = minors,
             by_minor: Callable[[], dict[int, dict[str, str]]] = driver_gpus) -> list[dict[str, Any]]:
    """The GPUs the CUDA processes ``pids`` use, as manifest entries (index, uuid, name, seen_as)."""
    pids = list(pids)
    mapped: set[int] = set()
    opened: set[int] = set()
    for pid in pids:
        m, o = minors_of(pid)
        mapped |= m
        opened |= o
    chosen, seen_as = (mapped, "mapped") if mapped else (opened, "open")
    table = by_minor()
    uuids = {table[n]["uuid"].lower() for n in chosen if n in table and table[n]["uuid"]}
    bus = {row["uuid"].lower(): row["bus"] for row in table.values() if row.get("uuid")}
    used = [g for g in visible if g.uuid.lower() in uuids]
    if chosen and used and len(used) == len(uuids):
        # By UUID (and PCI bus id, for people): the index is only the job's view, which
        # CUDA_VISIBLE_DEVICES or the allocation's cgroup renumbers on the next node.
        return [{**g.as_dict(), "bus": bus.get(g.uuid.lower(), ""), "seen_as": seen_as} for g in used]
    why = ("they hold no /dev/nvidiaN files" if not chosen else
           f"/dev/nvidia{sorted(chosen)} could not be matched to the GPUs visible here "
           f"({'no /proc/driver/nvidia/gpus' if not table else 'UUIDs differ, e.g. MIG'})")
    log(f"could not tell which GPUs PIDs {pids} use ({why}); recording all {len(visible)} visible GPU(s)")
    return [{**g.as_dict(), "seen_as": "visible"} for g in visible]


def plan(recorded: list[dict[str, Any]], here: list[Gpu], *, can_remap: bool) -> list[tuple[str, str]] | None:
    """None when the recorded GPUs are all here; else (old UUID, new UUID) pairs, one for
    every recorded GPU (identity pairs for those still here).

    Raises CudaCheckpointError, saying what differs, when this node cannot take the job."""
    if not recorded:
        return None
    by_uuid = {g.uuid.lower(): g for g in here}
    if all(str(r["uuid"]).lower() in by_uuid for r in recorded):
        return None
    taken = {str(r["uuid"]).lower() for r in recorded if str(r["uuid"]).lower() in by_uuid}
    free: dict[str, list[Gpu]] = defaultdict(list)
    for g in sorted(here, key=lambda g: g.index):
        if g.uuid.lower() not in taken:
            free[g.name].append(g)
    moved: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for r in sorted(recorded, key=lambda r: int(r.get("index", 0))):
        if str(r["uuid"]).lower() not in taken:
            moved[str(r["name"])].append(r)
    target: dict[str, str] = {}
    for model, olds in moved.items():
        if len(free[model]) < len(olds):
            have = ", ".join(f"{g.name} ({g.uuid})" for g in here) or "none"
            raise CudaCheckpointError(
                f"the image's CUDA processes used {len(olds)} {model} GPU(s) that are not here "
                f"({', '.join(str(r['uuid']) for r in olds)}), and this allocation has only {len(free[model])} "
                f"free GPU(s) of that model (GPUs here: {have}); a CUDA checkpoint restores only onto the same "
                "GPU model: request the same GPU count and model (e.g. --gres=gpu:<type>:N or --constraint)")
        for old, new in zip(olds, free[model]):
            target[str(old["uuid"])] = new.uuid
    if not can_remap:
        raise CudaCheckpointError(f"this allocation has other GPUs than the image ({', '.join(target)} are not "
                                  f"here) and restoring onto other GPUs needs {MIN_REMAP_TEXT}")
    return [(str(r["uuid"]), target.get(str(r["uuid"])) or by_uuid[str(r["uuid"]).lower()].uuid) for r in recorded]
