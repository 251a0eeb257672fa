"""One timed load in a fresh process, as a resumed job does it (``hpcckpt bench``).

A fresh process matters: a resumed job restores into memory it has barely touched,
and the first touch of new memory is part of what a load costs. Kinds::

    resume ROOT STEP RIG_BYTES [DEVICE]
                                 hpcckpt restore into a freshly built model + optimizer
                                 (on DEVICE, cpu or cuda: a cold restore onto the GPU)
    fresh ROOT STEP              hpcckpt load of rank 0 into new tensors (no model)
    torch FILE ROOT STEP RIG_BYTES [DEVICE]
                                 torch.load(weights_only=True) + load_state_dict into
                                 a freshly built model + optimizer
    rawfresh FILE                the raw parallel O_DIRECT read of FILE, into new memory
                                 (the disk's limit for bytes that must land where a
                                 load's new tensors do)

``RIG_BYTES`` is the size the bench built its ``SyntheticRig`` from; the model is
built from it again (parameters initialised, Adam without moments, as before any
restore) outside the timed part; on CUDA the clock stops once the device is synchronised. Every load verifies what it reads (hpcckpt:
crc32c of every tensor). Prints ``{"load_s": seconds}``. ``hpcckpt bench`` itself runs
``child_load`` in a child forked from its preloaded forkserver (``isolate``): the same
fresh heap without a fresh interpreter's imports.
"""
from __future__ import annotations

import json
import sys
import time
from pathlib import Path


def child_load(argv: list[str]) -> dict[str, float]:
    """``timed_load`` for ``isolate.run_isolated``."""
    return {"load_s": timed_load(argv)}


def main(argv: list[str]) -> int:
    try:
        elapsed = timed_load(argv)
    except ValueError as exc:
        print(f"loadproc: {exc}", file=sys.stderr)
        return 2
    print(json.dumps({"load_s": elapsed}))
    return 0


def timed_load(argv: list[str]) -> float:
    """Seconds of one load of the kind ``argv[0]`` names (see the module docstring)."""
    import torch

    from ..engines import load_rank
    from ..engines.base import live_tensors
    from ..state import Flat
    from ..store import catalog
    from .synthetic import SyntheticRig

    kind = argv[0] if argv else ""
    device = "cpu"
    if kind == "resume":
        root, step, rig_bytes = Path(argv[1]), int(argv[2]), int(argv[3])
        device = argv[4] if len(argv) > 4 else "cpu"
        info = catalog.find(root, step)
        rig = SyntheticRig(rig_bytes, warm=False, device=device)
        rig.sync()
        t0 = time.perf_counter()
        # what Checkpointer.register does: capture the live tensors (with the devices of the
        # optimizers' parameters, so missing optimizer state gets its GPU home), read into them
        live = live_tensors(rig.state.capture(step=0, plan=False).tensors, rig.state.objects)
        flat = load_rank(info, 0, 1, into=live)
        rig.state.restore(flat)
    elif kind == "fresh":
        info = catalog.find(Path(argv[1]), int(argv[2]))
        t0 = time.perf_counter()
        flat = load_rank(info, 0, 1)
    elif kind == "torch":
        path, root, step, rig_bytes = Path(argv[1]), Path(argv[2]), int(argv[3]), int(argv[4])
        device = argv[5] if len(argv) > 5 else "cpu"
        meta = (catalog.find(root, step).manifest or {})["ranks"]["0"]["meta"]
        rig = SyntheticRig(rig_bytes, warm=False, device=device)
        rig.sync()
        t0 = time.perf_counter()
        archive = torch.load(path, map_location="cpu", weights_only=True)
        rig.state.restore(Flat(tensors=archive["tensors"], meta=meta))
    elif kind == "rawfresh":
        from .limits import parallel_read_bps
        path = Path(argv[1])
        t0 = time.perf_counter() - path.stat().st_size / parallel_read_bps(path, fresh=True)
    else:
        raise ValueError(f"unknown kind {kind!r} (resume | fresh | torch | rawfresh)")
    if device == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - t0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
