"""One timed load in a fresh process, as a resumed job does it (``hpcckpt bench``).

``python -m hpcckpt.bench.loadproc hpcckpt ROOT STEP`` loads rank 0 of a committed
checkpoint with hpcckpt (read + crc32c verify); ``... torch FILE`` runs a bare
``torch.load(weights_only=True)``. Prints ``{"load_s": seconds}``. A fresh process
matters: a resumed job gets its tensors in memory it has never touched, and the
first touch of that memory is part of what a load costs.
"""
from __future__ import annotations

import json
import sys
import time
from pathlib import Path


def main(argv: list[str]) -> int:
    kind, target, rest = argv[0], Path(argv[1]), argv[2:]
    import torch

    from ..engines import load_rank
    from ..store import catalog

    if kind == "hpcckpt":
        info = catalog.find(target, int(rest[0]))
        t0 = time.perf_counter()
        result: object = load_rank(info, 0, 1)
    elif kind == "torch":
        t0 = time.perf_counter()
        result = torch.load(target, map_location="cpu", weights_only=True)
    else:
        print(f"loadproc: unknown kind {kind!r} (hpcckpt | torch)", file=sys.stderr)
        return 2
    elapsed = time.perf_counter() - t0
    del result
    print(json.dumps({"load_s": elapsed}))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
