"""``hpcckpt bench --peers``: hpcckpt against torch.save and DCP, the same state, one run.

Methods (``methods.available``: what the installed torch has; the JSON says which ran
and why any was left out): torch.save + fsync, DCP save, DCP async_save (thread;
process and async staging where torch has them), hpcckpt sync and concurrent. All save
the same ``PeerRig`` (a model + AdamW) on the device named.

Per round, methods interleaved (the order rotates by round): each method's saves run in
a child of their own (``isolate``: its peak RSS is its own), one first save then
``repeats`` steady ones in the loop ``forward/backward -> save -> forward/backward ->
optimizer.step``; then every method's newest checkpoint is restored cold (page cache
dropped: ``drop_caches`` as root, else ``posix_fadvise(DONTNEED)`` on its files; the JSON
names which) into a freshly built model + AdamW in a new child, and checked exact (sha256
of every model tensor and optimizer value, against the state as it was saved). Then the
training overhead: one child trains the rig ``steps`` steps without checkpoints and with
each method at each interval, interleaved, ``rounds`` times (one save in flight at a
time for every method: DCP's own advice for async_save; hpcckpt's max_async=1).

Figures per method: ``stall_s`` (time the training thread is blocked: the save call plus
any wait before the next optimizer.step; on CUDA at least the step's wall time beyond a
plain step), ``persist_s`` (save call to durable), ``restore_s`` (cold, fresh process),
``restore_exact``, ``save_held_vs_state``/``restore_held_vs_state`` (peak RSS beyond the
child's start, per byte of state), ``overhead`` {interval: fraction}, all samples kept.
``--quick`` on a CPU runs its children with one torch thread: at 16 MB a second OpenMP
thread spins (and on a shared machine gets preempted) more than it computes.
"""
from __future__ import annotations

import os
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from .isolate import held_vs_state, run_isolated
from .limits import GB, drop_caches, write_read_gbps
from .methods import Method, _Pending, available, import_for, make_method, restore, state_digest
from .synthetic import PeerRig

DEFAULT_GB, QUICK_GB = 0.5, 0.016
# The full run's intervals are those of the GPU issue's table; --quick saves at every step
# too (a 16 MB state), which at 0.5-3 GB would make the run disk-bound for many minutes.
INTERVALS, QUICK_INTERVALS = (5, 20), (1, 5)
Tick = Callable[[str], None]


@dataclass(frozen=True, kw_only=True)
class PeersOptions:
    size_bytes: int = int(DEFAULT_GB * GB)
    device: str = "cpu"
    dir: Path | None = None
    quick: bool = False
    rounds: int = 3
    repeats: int = 3
    intervals: tuple[int, ...] = INTERVALS
    steps: int = 40
    overhead_rounds: int = 3
    direct: bool | None = None
    threads: int = 0  # torch intra-op threads in the children; 0: torch's default

    @staticmethod
    def make(*, size_gb: float | None, device: str, dir: Path | None, quick: bool,
             direct: bool | None = None) -> PeersOptions:
        size = int((size_gb or (QUICK_GB if quick else DEFAULT_GB)) * GB)
        if quick:
            return PeersOptions(size_bytes=size, device=device, dir=dir, quick=True, rounds=1, repeats=2,
                                intervals=QUICK_INTERVALS, steps=10, overhead_rounds=1, direct=direct,
                                threads=1 if device == "cpu" else 0)
        # On a CPU a step of the 0.5 GB rig takes about as long as its AdamW update (~0.5 s on
        # 2 cores): one overhead round (15 runs of 40 steps) already takes minutes.
        return PeersOptions(size_bytes=size, device=device, dir=dir, direct=direct,
                            overhead_rounds=3 if device == "cuda" else 1)

    def engine_options(self) -> dict[str, Any]:
        return {"direct": self.direct} if self.direct is not None else {}


# -- in the children -----------------------------------------------------------------

def _rig(spec: dict[str, Any], **kwargs: Any) -> PeerRig:
    """The rig ``spec`` describes; its ``threads`` (when set) are torch's intra-op threads here."""
    spec = dict(spec)
    threads = spec.pop("threads", 0)
    if threads:
        torch.set_num_threads(threads)
    return PeerRig(**spec, **kwargs)


def _plain_step_s(rig: PeerRig) -> float:
    rig.sync()
    t0 = time.perf_counter()
    rig.step()
    rig.sync()
    return time.perf_counter() - t0


def one_checkpoint(m: Any, rig: PeerRig, step: int, *, digest: bool = False) -> dict[str, Any]:
    """One save inside a training step, as training sees it (see the module docstring)."""
    cuda = rig.device == "cuda"
    base_s = _plain_step_s(rig) if cuda else 0.0
    rig.forward_backward()
    saved = state_digest(rig) if digest else None  # the state as it is saved (untimed)
    rig.sync()
    hook0 = m.hook_wait_s()
    t0 = time.perf_counter()
    pending = m.start(step)
    call_s = time.perf_counter() - t0
    rig.forward_backward()
    t1 = time.perf_counter()
    m.before_step(pending)
    before_s = time.perf_counter() - t1
    rig.opt.step()  # hpcckpt concurrent's pre-hook waits here (CPU) or orders the GPU (CUDA)
    rig.sync()
    step_s = time.perf_counter() - t0
    persist_s = m.persist_s(pending)
    wait_s = before_s + m.hook_wait_s() - hook0
    stall = call_s + wait_s
    if cuda:
        stall = max(stall, step_s - base_s)
    return {"stall_s": stall, "call_s": call_s, "wait_s": wait_s, "persist_s": persist_s, "digest": saved,
            "path": str(pending.path)}


def child_save(name: str, root: str, spec: dict[str, Any], repeats: int, options: dict[str, Any]) -> dict[str, Any]:
    """A first save, then ``repeats`` steady ones; the newest stays for the restore."""
    rig = _rig(spec)
    m = make_method(name, Path(root), rig, options)
    try:
        first = one_checkpoint(m, rig, 1)
        runs = [one_checkpoint(m, rig, 2 + i, digest=i == repeats - 1) for i in range(repeats)]
    finally:
        m.close()
    return {"first": first, "runs": runs, "digest": runs[-1]["digest"], "path": runs[-1]["path"],
            "state_bytes": rig.state_bytes, "tensors": rig.tensor_count}


def child_restore(name: str, path: str, spec: dict[str, Any]) -> dict[str, Any]:
    """A cold restore into a freshly built rig (built before the clock starts), and its digest."""
    import_for(name)
    rig = _rig(spec, warm=False)
    rig.sync()
    t0 = time.perf_counter()
    restore(name, Path(path), rig)
    restore_s = time.perf_counter() - t0
    return {"restore_s": restore_s, "digest": state_digest(rig)}


def run_steps(rig: PeerRig, m: Method | None, first: int, last: int, interval: int, *,
              own_admission: bool = False) -> tuple[float, float, _Pending | None]:
    """Train steps ``first``..``last`` with ``m`` saving every ``interval`` steps (none when
    ``m`` is None), one save in flight at a time: (seconds, seconds of them blocked by
    checkpointing, the save still in flight). ``own_admission``: the method decides when a
    save may start (an hpcckpt engine's ``save()`` waits for a place as in a user's loop),
    instead of waiting here for the previous one to be durable; the save returned is the
    newest (an engine's saves become durable in order)."""
    pending: _Pending | None = None
    blocked = 0.0
    rig.sync()
    t0 = time.perf_counter()
    for s in range(first, last + 1):
        rig.forward_backward()
        if pending is not None:
            t1 = time.perf_counter()
            m.before_step(pending)  # type: ignore[union-attr]  # pending is set only when m is not None
            blocked += time.perf_counter() - t1
        rig.opt.step()
        if m is not None and s % interval == 0:
            t1 = time.perf_counter()
            if pending is not None and not own_admission:
                m.persist_s(pending)  # one save in flight at a time
            pending = m.start(s)
            blocked += time.perf_counter() - t1
    rig.sync()
    return time.perf_counter() - t0, blocked, pending


def _train(rig: PeerRig, name: str | None, interval: int, steps: int, root: Path,
           options: dict[str, Any]) -> tuple[float, float, float]:
    """(seconds of ``steps`` steps, seconds of them blocked by checkpointing, final drain)."""
    m = make_method(name, root, rig, options) if name else None
    wall, blocked, pending = run_steps(rig, m, 1, steps, interval)
    t1 = time.perf_counter()
    if m is not None:
        if pending is not None:
            m.persist_s(pending)
        blocked += m.hook_wait_s()
        m.close()
        shutil.rmtree(root, ignore_errors=True)
    return wall, blocked, time.perf_counter() - t1


def child_overhead(names: list[str], intervals: list[int], steps: int, rounds: int, spec: dict[str, Any],
                   root: str, options: dict[str, Any]) -> dict[str, Any]:
    """Baseline and every method x interval, interleaved, ``rounds`` times (one rig, one process)."""
    rig = _rig(spec)
    for name in names:  # warm-up, untimed: code paths, DCP's checkpoint daemon, allocator
        m = make_method(name, Path(root) / "warm", rig, options)
        m.persist_s(m.start(0))
        m.close()
        shutil.rmtree(Path(root) / "warm", ignore_errors=True)
    keys = [str(i) for i in intervals]
    base: list[float] = []
    got: dict[str, dict[str, dict[str, list[float]]]] = {
        n: {k: {"wall": [], "blocked": [], "drain": []} for k in keys} for n in names}
    for r in range(rounds):
        base.append(_train(rig, None, 1, steps, Path(root), options)[0])
        for name in _rotate(names, r):
            for k in keys:
                wall, blocked, drain = _train(rig, name, int(k), steps, Path(root) / name, options)
                got[name][k]["wall"].append(wall)
                got[name][k]["blocked"].append(blocked)
                got[name][k]["drain"].append(drain)
    return {"baseline_s": base, "runs": got, "steps": steps, "step_s": statistics.median(base) / steps}


# -- in the parent -------------------------------------------------------------------

class Ticker:
    """Numbered progress lines with the elapsed time: ``[peers 12.3s 4] what``."""

    def __init__(self, label: str, say: Tick) -> None:
        self.label, self.say, self.t0, self.done = label, say, time.monotonic(), 0

    def __call__(self, what: str) -> None:
        self.done += 1
        self.say(f"[{self.label} {self.elapsed_s():6.1f}s {self.done}] {what}")

    def elapsed_s(self) -> float:
        return time.monotonic() - self.t0


def _rotate(names: list[str], r: int) -> list[str]:
    k = r % max(1, len(names))
    return names[k:] + names[:k]


def measure_round(names: list[str], base: Path, spec: dict[str, Any], *, repeats: int, options: dict[str, Any],
                  r: int, tick: Tick) -> dict[str, dict[str, Any]]:
    """One round: every method's saves (its own child), then every method's cold restore."""
    saves: dict[str, dict[str, Any]] = {}
    for name in _rotate(names, r):
        shutil.rmtree(base / name, ignore_errors=True)
        saves[name] = run_isolated(child_save, name, str(base / name), spec, repeats, options)
        tick(f"{name}: stall {statistics.median(x['stall_s'] for x in saves[name]['runs']):.4f}s, "
             f"persist {statistics.median(x['persist_s'] for x in saves[name]['runs']):.3f}s")
    for name in _rotate(names, r):
        path = Path(saves[name]["path"])
        saves[name]["cold_cache"] = drop_caches([path])
        got = run_isolated(child_restore, name, str(path), spec)
        saves[name]["restore"] = got
        saves[name]["exact"] = got["digest"] == saves[name]["digest"]
        tick(f"{name}: cold restore {got['restore_s']:.3f}s, "
             + ("exact" if saves[name]["exact"] else "NOT EXACT"))
    return saves


def method_figures(rounds: list[dict[str, Any]], nbytes: int) -> dict[str, Any]:
    """Medians and every sample of one method over rounds (``measure_round`` results)."""
    runs = [x for r in rounds for x in r["runs"]]
    stalls, persists = [x["stall_s"] for x in runs], [x["persist_s"] for x in runs]
    restores = [r["restore"]["restore_s"] for r in rounds]
    out: dict[str, Any] = {
        "stall_s": statistics.median(stalls), "stall_all_s": stalls,
        "save_call_s": statistics.median(x["call_s"] for x in runs),
        "wait_before_step_s": statistics.median(x["wait_s"] for x in runs),
        "first_stall_s": statistics.median(r["first"]["stall_s"] for r in rounds),
        "persist_s": statistics.median(persists), "persist_all_s": persists,
        "restore_s": statistics.median(restores), "restore_all_s": restores,
        "restore_exact": all(r["exact"] for r in rounds),
        "save_held_vs_state": statistics.median(held_vs_state(r["rss"], nbytes) for r in rounds),
        "restore_held_vs_state": statistics.median(held_vs_state(r["restore"]["rss"], nbytes) for r in rounds),
        "save_held_bytes": statistics.median(r["rss"]["peak_bytes"] - r["rss"]["base_bytes"] for r in rounds),
        "restore_held_bytes": statistics.median(r["restore"]["rss"]["peak_bytes"] - r["restore"]["rss"]["base_bytes"]
                                                for r in rounds),
        "save_peak_rss_bytes": max(r["rss"]["peak_bytes"] for r in rounds),
        "restore_peak_rss_bytes": max(r["restore"]["rss"]["peak_bytes"] for r in rounds),
    }
    out["persist_gbps"] = nbytes / out["persist_s"] / GB
    out["restore_gbps"] = nbytes / out["restore_s"] / GB
    return out


def _overhead(raw: dict[str, Any]) -> dict[str, dict[str, dict[str, float]]]:
    """Per method and interval: the median over rounds of each run against its round's baseline."""
    base = raw["baseline_s"]
    out: dict[str, dict[str, dict[str, float]]] = {}
    for name, per in raw["runs"].items():
        fig: dict[str, dict[str, float]] = {"overhead": {}, "overhead_with_drain": {}, "overhead_blocked": {}}
        for k, got in per.items():
            fig["overhead"][k] = statistics.median(w / b - 1 for w, b in zip(got["wall"], base))
            fig["overhead_with_drain"][k] = statistics.median(
                (w + d) / b - 1 for w, d, b in zip(got["wall"], got["drain"], base))
            fig["overhead_blocked"][k] = statistics.median(x / b for x, b in zip(got["blocked"], base))
        out[name] = fig
    return out


def _ratios(methods: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """Each method against torch.save/torch.load, and hpcckpt concurrent against DCP async_save."""
    ref = methods.get("torch_save")
    out: dict[str, Any] = {}
    if ref:
        out["vs_torch_save"] = {n: {"stall": m["stall_s"] / ref["stall_s"], "persist": m["persist_s"] / ref["persist_s"],
                                    "restore": m["restore_s"] / ref["restore_s"]} for n, m in methods.items()}
    conc, dcp = methods.get("hpcckpt_concurrent"), methods.get("dcp_async")
    if conc and dcp and "overhead" in conc:
        out["concurrent_ahead_of_dcp_async"] = {k: conc["overhead"][k] < dcp["overhead"][k] for k in conc["overhead"]}
    return out


def run_peers(o: PeersOptions, progress: Tick = lambda s: None) -> dict[str, Any]:
    """Measure every available method; the result tree (see the module docstring)."""
    names_desc, skipped = available(o.device)
    names = list(names_desc)
    spec = {"state_bytes": o.size_bytes, "tensors": None, "device": o.device, "threads": o.threads}
    options = o.engine_options()
    base = Path(tempfile.mkdtemp(prefix="hpcckpt-peers-", dir=o.dir))
    tick = Ticker("peers", progress)

    progress(f"[peers] {o.device}, {len(names)} methods, state {o.size_bytes / GB:.3f} GB, files under {base}"
             + (f"; left out: {', '.join(f'{n} ({w})' for n, w in skipped.items())}" if skipped else ""))
    try:
        limits = write_read_gbps(base, max(o.size_bytes, 64 << 20))
        tick(f"disk: raw parallel write {limits['write_gbps']:.2f} GB/s, read {limits['read_gbps']:.2f} GB/s")
        rounds = [measure_round(names, base, spec, repeats=o.repeats, options=options, r=r, tick=tick)
                  for r in range(o.rounds)]
        raw = run_isolated(child_overhead, names, list(o.intervals), o.steps, o.overhead_rounds, spec,
                           str(base / "overhead"), options)
        tick("training overhead: " + ", ".join(
            f"{n} {'/'.join(f'{100 * (w / b - 1):.0f}%' for w, b in ((per[k]['wall'][0], raw['baseline_s'][0]) for k in per))}"
            for n, per in raw["runs"].items()))
    finally:
        shutil.rmtree(base, ignore_errors=True)
    first = rounds[0][names[0]]
    nbytes = int(first["state_bytes"])
    methods = {n: {"what": names_desc[n], **method_figures([r[n] for r in rounds], nbytes)} for n in names}
    for n, fig in _overhead(raw).items():
        methods[n].update(fig)
    return {
        "kind": "peers", "device": o.device, "state_bytes": nbytes, "tensors": first["tensors"],
        "methods": methods, "skipped": skipped, "all_exact": all(m["restore_exact"] for m in methods.values()),
        "cold_cache": first.get("cold_cache", ""), "limits": limits, **_ratios(methods),
        "overhead_detail": {"baseline_s": raw["baseline_s"], "steps": raw["steps"], "step_s": raw["step_s"],
                            "intervals": list(o.intervals), "runs": raw["runs"]},
        "machine": {"cpus": os.cpu_count(), "torch": torch.__version__, "dir": str(o.dir or tempfile.gettempdir())},
        "options": {"quick": o.quick, "rounds": o.rounds, "repeats": o.repeats, "overhead_rounds": o.overhead_rounds,
                    "torch_threads": o.threads or torch.get_num_threads(), **options},
        "wall_s": tick.elapsed_s(),
        "children_cpu_s": raw["cpu_s"] + sum(x.get("cpu_s", 0.0) + x["restore"].get("cpu_s", 0.0)
                                             for r in rounds for x in r.values()),
    }


def text(res: dict[str, Any]) -> str:
    """The result as a table (``--json`` prints the tree instead)."""
    keys = [str(i) for i in res["overhead_detail"]["intervals"]]
    lines = [f"{res['device']}: {res['state_bytes'] / GB:.3f} GB of state over {res['tensors']} tensors; "
             f"disk raw write {res['limits']['write_gbps']:.2f} GB/s, read {res['limits']['read_gbps']:.2f} GB/s; "
             f"cold cache by {res['cold_cache']}",
             f"{'method':<20}{'stall s':>9}{'persist s':>10}{'restore s':>10}{'exact':>6}{'RSS save':>9}"
             f"{'restore':>8}" + "".join(f"{'ovh@' + k:>9}" for k in keys)]
    for n, m in res["methods"].items():
        lines.append(f"{n:<20}{m['stall_s']:>9.4f}{m['persist_s']:>10.3f}{m['restore_s']:>10.3f}"
                     f"{'yes' if m['restore_exact'] else 'NO':>6}{m['save_held_vs_state']:>8.2f}x"
                     f"{m['restore_held_vs_state']:>7.2f}x" + "".join(f"{100 * m['overhead'][k]:>8.1f}%" for k in keys))
    for n, why in res["skipped"].items():
        lines.append(f"{n}: left out ({why})")
    if not res["all_exact"]:
        lines.append("a restore was NOT exact: see restore_exact per method")
    return "\n".join(lines)
