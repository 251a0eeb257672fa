"""Multi-level checkpoints: node-local storage (and a partner node's copy) often, the shared
directory less often, restart inside the allocation from the fastest level that holds the
newest complete step.

Each level holds checkpoints in the store's one format (``step-N/`` with a manifest), so every
reader, verifier and tool works on any of them:

- **node-local**: ``<local>/<key>/`` on each node (``Levels.local``; the prolog-made staging
  directory of the job, ``$HPCCKPT_LOCAL_DIR`` or ``/dev/shm``), written by the engine itself.
  Its step directories carry the full manifest but only the rank files of the node's own ranks
  and, with ``partner``, those of the ranks whose partner it is (``Topology.partner``).
- **shared**: the checkpoint directory (``Levels.shared``), drained from the node-local copy
  (never from the device again) every ``every_steps`` and at every stop, committed only after
  each copied file reads back with the checksum of its source (``levels.save.drain``).
- At the end of an allocation the epilog's ``hpcckpt scavenge`` commits a node-local step the
  shared level lacks (``store.scavenge``).

``save.commit`` is the engines' commit when levels are on; ``restore.prepare`` picks the step
all ranks restore from and completes each node's copy of it from the others.
"""
from __future__ import annotations

import json
import os
import sys
from dataclasses import dataclass
from pathlib import Path

from ..config import CheckpointOptions
from ..errors import ConfigError
from ..ranks import Ranks
from ..store.scavenge import POINTER, level_key  # the pointer in each node-local root, read by the scavenge
from .topology import Topology

__all__ = ["Levels", "Topology", "POINTER", "local_root"]


@dataclass(frozen=True)
class Levels:
    shared: Path  # the checkpoint directory (shared file system)
    local: Path  # this node's node-local root for it
    topo: Topology
    shared_every: int | None  # the shared level every this many steps (None: only at stops)
    keep: int  # shared level retention
    local_keep: int
    partner: bool

    def shared_due(self, step: int, final: bool) -> bool:
        """Whether the checkpoint of ``step`` also goes to the shared level."""
        return final or (self.shared_every is not None and step % self.shared_every == 0)

    @property
    def with_partner(self) -> bool:
        return self.partner and len(self.topo.nodes) > 1

    @staticmethod
    def make(options: CheckpointOptions, ranks: Ranks, node: str, staging: Path | None) -> Levels:
        """The levels of this job (collective: the ranks learn each other's nodes)."""
        assert options.local_every_steps is not None
        topo = Topology.gather(ranks, node)
        local = local_root(options.dir, options.local_dir, node, staging)
        if topo.is_leader:
            _point(local, options.dir)
        ranks.max(0)  # every node's root exists before any rank writes in it
        return Levels(shared=options.dir, local=local, topo=topo, shared_every=options.every_steps,
                      keep=options.keep, local_keep=options.local_keep, partner=options.partner)


def local_root(shared: Path, local_dir: str | None, node: str, staging: Path | None) -> Path:
    """This node's node-local root for the checkpoint directory ``shared``: one directory per
    checkpoint directory (named by a hash of its path) under ``local_dir`` (``%n``: the node
    name), else the job's staging directory (slurm/prolog), else ``/dev/shm/hpcckpt-<uid>``."""
    if local_dir is not None:
        base = Path(local_dir.replace("%n", node)).expanduser()
    elif staging is not None:
        base = staging / "levels"
    else:
        base = Path("/dev/shm") / f"hpcckpt-{os.getuid()}"
    root = base / level_key(shared)
    try:
        root.mkdir(mode=0o700, parents=True, exist_ok=True)
    except OSError as exc:
        raise ConfigError(f"the node-local checkpoint level {root} cannot be made ({exc.strerror}); name a "
                          "writable node-local directory: local_dir=... or HPCCKPT_LOCAL_DIR=/local/$USER/hpcckpt"
                          ) from None
    return root


def _point(local: Path, shared: Path) -> None:
    """Write what the epilog's scavenge needs in ``local``: the shared directory and this Python."""
    doc = json.dumps({"shared": str(Path(shared).absolute()), "python": sys.executable}).encode()
    tmp = local / f"{POINTER}.{os.getpid()}"
    with open(tmp, "wb") as f:
        f.write(doc)
    os.replace(tmp, local / POINTER)
