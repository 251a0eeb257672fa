"""``hpcckpt bench --tensors N[,N...]``: what each method costs as the tensor count grows.

For each count N, the same total state (``--size-gb``; default 0.256 GB, --quick 0.008)
is spread over about N tensors (N/4 flat parameters, each with AdamW's exp_avg,
exp_avg_sq and step: ``PeerRig(tensors=N)``), and torch.save/torch.load, DCP save/load
and both hpcckpt engines save and restore it, interleaved, exactly as ``bench --peers``
measures them (``peers.measure_round``: saves in a child each, cold restores in a
fresh child each, every restore checked exact). For the hpcckpt engines also
``verify_s``: a cold ``hpcckpt verify`` of the newest checkpoint (every byte re-read,
every crc32c checked; in a child of its own) beside ``raw_read_s``, a cold parallel
O_DIRECT read of the same files: three such pairs (one with --quick), their medians and
the median of their ratios.

Per count and method: ``stall_s``, ``durable_s`` (save call to durable), ``restore_s``,
``restore_exact``, ``save_held_vs_state``/``restore_held_vs_state`` (peak RSS beyond the
child's start per byte of state), and for hpcckpt ``verify_s``, ``verify_vs_raw_read``;
``vs_torch`` gives each method's durable and restore against torch.save/torch.load.
"""
from __future__ import annotations

import shutil
import statistics
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..errors import ConfigError
from .isolate import run_isolated
from .limits import GB, drop_caches, parallel_read_bps
from .methods import HPCCKPT, available
from .peers import Ticker, measure_round, method_figures

DEFAULT_GB, QUICK_GB = 0.256, 0.008
METHODS = ("torch_save", "dcp_save", *HPCCKPT)
MAX_TENSORS = 1 << 22


@dataclass(frozen=True, kw_only=True)
class TensorsOptions:
    counts: tuple[int, ...]
    size_bytes: int = int(DEFAULT_GB * GB)
    device: str = "cpu"
    dir: Path | None = None
    quick: bool = False
    rounds: int = 1
    repeats: int = 3
    direct: bool | None = None

    @staticmethod
    def make(*, counts: tuple[int, ...], size_gb: float | None, device: str, dir: Path | None, quick: bool,
             direct: bool | None = None) -> TensorsOptions:
        size = int((size_gb or (QUICK_GB if quick else DEFAULT_GB)) * GB)
        if size // (12 * max(1, max(counts) // 4)) < 1:
            raise ConfigError(f"--tensors {max(counts)}: {size / GB:g} GB cannot be spread over that many tensors "
                              f"(each parameter needs 12 bytes with AdamW); give a larger --size-gb or fewer tensors")
        return TensorsOptions(counts=counts, size_bytes=size, device=device, dir=dir, quick=quick,
                              repeats=1 if quick else 3, direct=direct)


def parse_counts(raw: str) -> tuple[int, ...]:
    """``--tensors 64,1024,8192``: whole numbers from 4 to 2^22 (each parameter brings 4 state tensors)."""
    counts = []
    for word in raw.split(","):
        try:
            n = int(word.strip())
        except ValueError:
            raise ConfigError(f"--tensors {raw}: {word.strip()!r} is not a whole number "
                              "(e.g. --tensors 64,1024,8192)") from None
        if not 4 <= n <= MAX_TENSORS:
            raise ConfigError(f"--tensors {raw}: {n} is out of range; give counts from 4 to {MAX_TENSORS} "
                              "(e.g. --tensors 64,1024,8192)")
        counts.append(n)
    return tuple(sorted(set(counts)))


def child_verify(root: str, step: int) -> dict[str, Any]:
    """A full verify of one checkpoint (``hpcckpt verify``'s path), timed."""
    from ..store import catalog
    t0 = time.perf_counter()
    info = catalog.inspect_step(Path(root), step, full=True)
    verify_s = time.perf_counter() - t0
    return {"verify_s": verify_s, "status": None if info is None else info.status,
            "problems": [] if info is None else info.problems[:5]}


def _raw_read_s(step_dir: Path) -> float:
    files = [p for p in step_dir.iterdir() if p.is_file()]
    drop_caches(files)
    return sum(p.stat().st_size / parallel_read_bps(p) for p in files if p.stat().st_size)


VERIFY_PAIRS = 3  # (cold raw read, cold verify) pairs; one pair alone varied by 1.5x from run to run


def _verify(name: str, saves: dict[str, Any], n_pairs: int) -> dict[str, Any]:
    """``n_pairs`` cold raw reads, each followed by a cold verify; the medians, and the
    median of the pairs' ratios."""
    step_dir = Path(saves["path"])
    pairs = []
    for _ in range(n_pairs):
        raw_s = _raw_read_s(step_dir)
        drop_caches([step_dir])
        got = run_isolated(child_verify, str(step_dir.parent), int(step_dir.name.split("-")[1]))
        pairs.append((raw_s, got))
    return {"verify_s": statistics.median(g["verify_s"] for _r, g in pairs),
            "verify_all_s": [g["verify_s"] for _r, g in pairs],
            "verify_status": next((g["status"] for _r, g in pairs if g["status"] != "committed"), "committed"),
            "verify_problems": [p for _r, g in pairs for p in g["problems"]][:5],
            "raw_read_s": statistics.median(r for r, _g in pairs),
            "verify_vs_raw_read": statistics.median(g["verify_s"] / max(r, 1e-9) for r, g in pairs)}


def _one_count(o: TensorsOptions, n: int, base: Path, names: list[str],
               tick: Callable[[str], None]) -> dict[str, Any]:
    # --quick on a CPU: one torch thread (a second spins more than it helps at that size)
    spec = {"state_bytes": o.size_bytes, "tensors": n, "device": o.device,
            "threads": 1 if o.quick and o.device == "cpu" else 0}
    options = {"direct": o.direct} if o.direct is not None else {}
    rounds, verifies = [], []
    for r in range(o.rounds):
        got = measure_round(names, base, spec, repeats=o.repeats, options=options, r=r, tick=tick)
        verifies.append({name: _verify(name, got[name], 1 if o.quick else VERIFY_PAIRS)
                         for name in names if name in HPCCKPT})
        rounds.append(got)
    first = rounds[0][names[0]]
    nbytes = int(first["state_bytes"])
    methods: dict[str, Any] = {}
    for name in names:
        fig = method_figures([r[name] for r in rounds], nbytes)
        fig["durable_s"] = fig["persist_s"]
        if name in HPCCKPT:
            per = [v[name] for v in verifies]
            fig.update({"verify_s": statistics.median(v["verify_s"] for v in per),
                        "raw_read_s": statistics.median(v["raw_read_s"] for v in per),
                        "verify_vs_raw_read": statistics.median(v["verify_vs_raw_read"] for v in per),
                        "verify_ok": all(v["verify_status"] == "committed" for v in per),
                        "verify_problems": [p for v in per for p in v["verify_problems"]]})
        methods[name] = fig
    for name in names:
        shutil.rmtree(base / name, ignore_errors=True)
    ref = methods.get("torch_save")
    vs = {m: {"durable": f["durable_s"] / ref["durable_s"], "restore": f["restore_s"] / ref["restore_s"]}
          for m, f in methods.items()} if ref else {}
    tick(f"{first['tensors']} tensors: " + ", ".join(f"{m} durable {f['durable_s']:.3f}s" for m, f in methods.items()))
    return {"tensors_requested": n, "tensors": first["tensors"], "state_bytes": nbytes, "methods": methods,
            "vs_torch": vs, "cold_cache": first.get("cold_cache", "")}


def run_tensors(o: TensorsOptions, progress: Callable[[str], None] = lambda s: None) -> dict[str, Any]:
    """Every count, every method; the result tree (see the module docstring)."""
    have, skipped = available(o.device)
    names = [n for n in METHODS if n in have]
    base = Path(tempfile.mkdtemp(prefix="hpcckpt-tensors-", dir=o.dir))
    tick = Ticker("tensors", progress)

    progress(f"[tensors] {o.device}, {o.size_bytes / GB:.3f} GB over {', '.join(map(str, o.counts))} tensors, "
             f"methods {', '.join(names)}; files under {base}")
    try:
        counts = [_one_count(o, n, base, names, tick) for n in o.counts]
    finally:
        shutil.rmtree(base, ignore_errors=True)
    return {"kind": "tensors", "device": o.device, "state_bytes": counts[0]["state_bytes"], "counts": counts,
            "skipped": {n: w for n, w in skipped.items() if n in METHODS},
            "all_exact": all(m["restore_exact"] for c in counts for m in c["methods"].values()),
            "options": {"quick": o.quick, "rounds": o.rounds, "repeats": o.repeats, "direct": o.direct},
            "wall_s": tick.elapsed_s()}


def text(res: dict[str, Any]) -> str:
    lines = [f"{res['device']}: {res['state_bytes'] / GB:.3f} GB of state; durable and restore against "
             "torch.save / torch.load; RSS = peak beyond start, per byte of state",
             f"{'tensors':>8} {'method':<20}{'stall s':>9}{'durable s':>10}{'restore s':>10}{'verify s':>9}"
             f"{'dur/torch':>10}{'rst/torch':>10}{'RSS save':>9}{'restore':>8}{'exact':>6}"]
    for c in res["counts"]:
        for name, m in c["methods"].items():
            vs = c["vs_torch"].get(name, {})
            verify = f"{m['verify_s']:>9.3f}" if "verify_s" in m else f"{'':>9}"
            lines.append(f"{c['tensors']:>8} {name:<20}{m['stall_s']:>9.4f}{m['durable_s']:>10.3f}"
                         f"{m['restore_s']:>10.3f}{verify}{vs.get('durable', float('nan')):>9.2f}x"
                         f"{vs.get('restore', float('nan')):>9.2f}x{m['save_held_vs_state']:>8.2f}x"
                         f"{m['restore_held_vs_state']:>7.2f}x{'yes' if m['restore_exact'] else 'NO':>6}")
    if not res["all_exact"]:
        lines.append("a restore was NOT exact: see restore_exact per method")
    return "\n".join(lines)
