"""Writing a JIT checkpoint: one file, the usual commit protocol.

The format is hpcckpt/4 with the job's world size, restored through the ordinary
path on any number of ranks: one torch archive, ``jit.pt``, holds every replicated
tensor once (parameters and optimizer state, from the writer's live memory: one
piece each, held by the writer's record in the ``shared`` table) and the rank-local
tensors of each survivor under ``jit/rank<R>/<name>``; every rank's record lists the
local ones of its source (itself when it survived at the agreed step, else the
writer: its RNG, sampler and scheduler state are those of the writer, which is exact
when they do not depend on the rank, as with ``ResumableSampler`` and ranks seeded
alike). Rank files are fsynced, the manifest is sealed and written last, the
directory renamed, LATEST replaced: a save cut short leaves only a ``.tmp-``
directory, which is never loaded.
"""
from __future__ import annotations

import logging
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from ..store import catalog, torchfile
from ..store.commit import Transaction
from ..store.manifest import build as build_manifest
from ..store.names import JIT_FILE, TORCH, rank_record
from ..store.publish import commit_and_prune

log = logging.getLogger("hpcckpt.jit")

ENGINE = "jit"
LOCK_TIMEOUT_S = 60.0


def renamed(meta: Any, names: Mapping[str, str]) -> Any:
    """``meta`` with every tensor reference ``{"__tensor__": n}`` replaced by ``names[n]``."""
    if isinstance(meta, list):
        return [renamed(v, names) for v in meta]
    if not isinstance(meta, dict):
        return meta
    out = {}
    for k, v in meta.items():
        if k in ("__tensor__", "__ndarray__") and isinstance(v, str):
            out[k] = names[v]
        else:
            out[k] = renamed(v, names)
    return out


def local_name(src: int, name: str) -> str:
    return f"jit/rank{src}/{name}"


def write_file(tmp: Path, tensors: Mapping[str, torch.Tensor]) -> dict[str, Any]:
    """The archive, fsynced (a seam for fault-injection tests)."""
    return torchfile.write(tmp / JIT_FILE, tensors)


def commit(root: Path, *, step: int, world: int, writer_rank: int, keep: int, job: Mapping[str, Any],
           user: Mapping[str, Any], replicated_trees: Mapping[str, Any],
           replicated: Mapping[str, torch.Tensor], sources: Mapping[int, tuple[Mapping[str, torch.Tensor], Any]],
           source_of: Mapping[int, int], info: Mapping[str, Any]) -> Path:
    """Write and commit step ``step``; returns its directory. ``sources[src] = (local tensors, trees)``;
    ``writer_rank`` (a source of itself) holds the replicated tensors' pieces.

    Local tensors whose name is also a replicated one (module buffers, which every
    rank copies at the boundary) take precedence in that source's records.
    """
    tensors: dict[str, torch.Tensor] = dict(replicated)
    names_of: dict[int, dict[str, str]] = {}
    for src, (local, _trees) in sources.items():
        names = {}
        for n, t in local.items():
            tensors[local_name(src, n)] = t
            names[n] = local_name(src, n)
        names_of[src] = names
    with Transaction(root, catalog.step_name(step)) as txn:
        rec = write_file(txn.path, tensors)
        entries = rec["tensors"]
        holder = writer_rank
        shared = {n: {"dtype": entries[n]["dtype"], "shape": list(entries[n]["shape"]), "kind": "replicated",
                      "pieces": [{"rank": holder, "start": 0, "nbytes": entries[n]["nbytes"]}]}
                  for n in replicated}
        ranks: dict[str, Any] = {}
        for r in range(world):
            src = source_of[r]
            _local, trees = sources[src]
            names = {**{n: n for n in replicated}, **names_of[src]}  # a local buffer copy wins over a live one
            meta = {"step": step, "user": trees.get("user", {}),
                    "objects": {**replicated_trees, **trees["objects"]}, "rng": trees["rng"]}
            meta = renamed(meta, names)
            held = sorted(set(names_of[src].values()) | (set(replicated) if r == holder else set()))
            ranks[str(r)] = rank_record(file=JIT_FILE, fmt=TORCH, meta=meta, tensors={n: entries[n] for n in held})
        manifest = build_manifest(step=step, engine=ENGINE, job=job, user=user,
                                  records=[ranks[str(r)] for r in range(world)], shared=shared,
                                  files={JIT_FILE: rec["file_info"]}, jit=dict(info))
        path, faults, _removed = commit_and_prune(txn, manifest, keep=keep, lock_timeout_s=LOCK_TIMEOUT_S)
        for fault in faults:
            log.warning("hpcckpt: jit: %s", fault)
    return path
