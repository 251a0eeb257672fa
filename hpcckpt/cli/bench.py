"""``hpcckpt bench``: raw write/read/memcpy limits, then the sync and concurrent engines.

Per engine: visible stall per checkpoint, durable persist time and GB/s, cold-cache
load time and GB/s, and the training overhead on the demo model at checkpoint
intervals 1, 10 and 50. Run as root for true cold-cache reads (drop_caches).
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from .common import add_json, emit


def register(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = sub.add_parser("bench", help="measure stall, persist and load of each engine against this machine's limits",
                       description=__doc__)
    p.add_argument("--size-gb", type=float, default=None,
                   help="largest state size in GB (default 2; smaller sizes are measured too)")
    p.add_argument("--dir", type=Path, default=None, help="file system to measure (default: the system temp dir)")
    p.add_argument("--plot", type=Path, default=None, help="write a PNG figure here")
    p.add_argument("--quick", action="store_true", help="tiny sizes and few steps (seconds; for tests)")
    p.add_argument("--buffered", dest="direct", action="store_false", default=None,
                   help="concurrent engine writes through the page cache (default: O_DIRECT, HPCCKPT_DIRECT)")
    add_json(p)
    p.set_defaults(func=run)


def text(res: dict[str, Any]) -> str:
    lim, t = res["limits"], res["targets"]
    lines = [f"state {res['state_bytes'] / 1e9:.2f} GB; limits: write {lim['write_gbps']:.2f} GB/s (direct+fsync), "
             f"read {lim['read_gbps']:.2f} GB/s (cold), memcpy {lim['memcpy_gbps']:.2f} GB/s",
             f"{'engine':<11}{'stall s':>9}{'persist s':>11}{'GB/s':>7}{'load s':>9}{'GB/s':>7}"
             + "".join(f"{'ovh@' + i:>9}" for i in ("1", "10", "50"))]
    for name, e in res["engines"].items():
        ovh = res["overhead"].get(name, {})
        lines.append(f"{name:<11}{e['stall_s']:>9.3f}{e['persist_s']:>11.3f}{e['persist_gbps']:>7.2f}"
                     f"{e['load_s']:>9.3f}{e['load_gbps']:>7.2f}"
                     + "".join(f"{100 * ovh.get(i, float('nan')):>8.1f}%" for i in ("1", "10", "50")))
    lines.append(f"stall vs sync {t['stall_vs_sync']:.3f} (<= 0.1); stall vs memcpy bound "
                 f"{t['stall_vs_memcpy_bound']:.2f} (<= 1.3); persist vs write {t['persist_vs_write']:.2f} (>= 0.85); "
                 f"load vs read {t['load_vs_read']:.2f} (>= 0.85, same file, same round; fresh memory allows "
                 f"{t['load_vs_read_fresh_memory_ceiling']:.2f})")
    if t["load_vs_torch_load"] is not None:
        lines.append(f"load vs torch.load {t['load_vs_torch_load']:.2f}x (>= 3); a raw read of the same bytes "
                     f"reaches {t['load_vs_torch_load_ceiling']:.2f}x"
                     + ("" if t["load_vs_torch_load_reachable"] else " (the disk itself cannot reach 3x)"))
    lines.append("blocked fraction @10: " + ", ".join(f"{n} {100 * v:.1f}%" for n, v in t["overhead_blocked_at_10"].items()))
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    from ..bench import BenchOptions, run_bench
    from ..bench.plot import plot_bench

    o = BenchOptions.make(size_gb=args.size_gb, dir=args.dir, quick=args.quick, direct=args.direct)
    res = run_bench(o, progress=lambda s: None)
    if args.plot:
        plot_bench(res, args.plot)
        res["plot"] = str(args.plot)
        print(f"hpcckpt bench: plot written to {args.plot}", file=sys.stderr)
    emit(args, res, text(res))
    return 0
