"""``hpcckpt bench``: this machine's limits, then the sync and concurrent engines against them.

In one run, paired: the disk (raw parallel O_DIRECT write and read of the same bytes),
host copies and, on a GPU, pinned device<->host copies; per engine the stall per
checkpoint (save call + optimizer pre-hook), the snapshot's copy rate, the first save
against a steady one, durable persist against the raw write, cold restore (onto the
GPU with --device cuda) against the raw read and against torch.load + load_state_dict,
the stall at staging budgets of 100/50/25% of the state, and the training overhead at
checkpoint intervals 1, 10 and 50. Progress lines go to stderr; with --json stdout
holds only the result. Run as root for true cold-cache reads (drop_caches).

With --ranks N: a DDP job (synthetic model + Adam, gloo on CPU) on 1 and on N local
ranks, per engine: bytes written per rank and per checkpoint against the state's size
(replicated state is written once, striped over the ranks) and the persist time of a
blocking save against 1 rank (default state 0.5 GB, --quick 0.016 GB); then the
steady-state overhead of jit=True with no failure on N ranks: the same DDP training
loop with jit=False and jit=True, in paired rounds (wall clock, CPU time, and the JIT
guard's own cost at a step boundary).

With --peers: the same state (a model + AdamW) saved and restored by torch.save + fsync,
DCP save, DCP async_save (thread; process and async staging where the installed torch
has them) and both hpcckpt engines, interleaved: stall, persist, cold restore (checked
exact), peak RSS per byte of state, and training overhead at a few checkpoint intervals,
on --device (default state 0.5 GB, --quick 0.016 GB). With --peers --mesh DPxTP: DCP
save, DCP async_save and both engines on a 2-D sharded state instead: DP x TP local
ranks (gloo on CPU) train an FSDP2 x tensor-parallel MLP + AdamW; per method the slowest
rank's stall, persist and cold restore (checked exact on every rank) and the bytes
written against the state (default state 0.256 GB, --quick 0.016 GB). With --tensors N[,N...]: the same
total state (default 0.256 GB, --quick 0.008) spread over N tensors, per count: stall,
durable, restore, verify and peak RSS of torch.save/torch.load, DCP and both engines.

With --small-state [MB,MS]: only the small-state figure of the default bench, on --device:
a state of MB megabytes (default 3) whose step takes MS milliseconds (default 6; the
batch is calibrated to it) saved at every step by both engines, in alternating blocks
of steps with and without checkpoints: the overhead and the cost per save (what a save
costs beyond its bytes). E.g. --small-state 1.4,19 for a nanoGPT-sized state.

With --levels: each checkpoint level on this machine (hpcckpt.levels), side by side in
one run: write+fsync and cold read of a checkpoint-sized file set (default 0.5 GB,
--quick 0.016 GB) in MB/s on the node-local directory (--local-dir, else
$HPCCKPT_LOCAL_DIR, else the job's staging directory, else /dev/shm) and on --dir (the
shared level), and the partner copy between the 2 ranks of a gloo process group; then
the training overhead of a checkpoint at every step with the concurrent engine at the
node-local level (local_every_steps=1) next to the shared directory (every_steps=1),
paired rounds on the demo model, and their ratio.
"""
from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path
from typing import Any

from .common import add_json, emit


def size_gb(raw: str) -> float:
    """``--size-gb``: a finite positive number (the disk check needs --dir and comes later)."""
    try:
        value = float(raw)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{raw!r} is not a number of GB (e.g. --size-gb 2)") from None
    if not math.isfinite(value) or value <= 0:
        raise argparse.ArgumentTypeError(f"{raw!r}: give a state size in GB above zero (e.g. --size-gb 2)")
    return value


def ranks_arg(raw: str) -> int:
    """``--ranks``: a whole number of local ranks, 2 or more (1 rank is the baseline, always measured)."""
    try:
        value = int(raw)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{raw!r} is not a whole number of ranks (e.g. --ranks 4)") from None
    if value < 2:
        raise argparse.ArgumentTypeError(f"{raw!r}: give 2 or more ranks (1 rank is always measured as the "
                                         "baseline), e.g. --ranks 4")
    return value


def tensors_arg(raw: str) -> tuple[int, ...]:
    """``--tensors``: comma-separated tensor counts (``hpcckpt.bench.tensors.parse_counts``)."""
    from ..bench.tensors import parse_counts
    from ..errors import ConfigError
    try:
        return parse_counts(raw)
    except ConfigError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("bench", help="measure stall, persist and load of each engine against this machine's limits",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--size-gb", type=size_gb, default=None,
                   help="largest state size in GB (default 2, --quick 0.016; smaller sizes are measured too; "
                        "with --ranks: the state of the DDP job, default 0.5, --quick 0.016)")
    p.add_argument("--ranks", type=ranks_arg, default=None, metavar="N",
                   help="bytes written per rank and per checkpoint, and persist time, of a DDP job on N local "
                        "ranks against 1 rank, and the overhead of jit=True on N ranks (gloo on CPU; N >= 2)")
    p.add_argument("--peers", action="store_true",
                   help="hpcckpt against torch.save + fsync and DCP (save, async_save) on the same state, "
                        "interleaved: stall, persist, cold restore, overhead")
    p.add_argument("--mesh", default=None, metavar="DPxTP",
                   help="with --peers: DCP (save, async_save) and both hpcckpt engines on a 2-D sharded state "
                        "instead, DP x TP local ranks (gloo on CPU) training an FSDP2 x tensor-parallel model "
                        "(e.g. --mesh 2x2): stall, persist, cold restore (checked exact), bytes written")
    p.add_argument("--tensors", type=tensors_arg, default=None, metavar="N[,N...]",
                   help="the same state spread over N tensors (e.g. 64,1024,8192): stall, durable, restore, "
                        "verify and peak RSS per count, against torch.save/torch.load and DCP")
    p.add_argument("--levels", action="store_true",
                   help="node-local, partner and shared level bandwidth side by side (MB/s), and the overhead of "
                        "a checkpoint at every step at the node-local level against the shared directory")
    p.add_argument("--small-state", nargs="?", const="3,6", default=None, metavar="MB,MS",
                   help="only the small-state figure: a state of MB megabytes with MS ms steps saved at every "
                        "step by both engines (default 3,6)")
    p.add_argument("--local-dir", default=None, metavar="DIR",
                   help="with --levels: the node-local level's directory (default: as the levels resolve it, "
                        "$HPCCKPT_LOCAL_DIR, the job's staging directory or /dev/shm)")
    p.add_argument("--device", default="auto", help="auto (cuda when a GPU is visible), cuda or cpu")
    p.add_argument("--dir", type=Path, default=None,
                   help="file system to measure (created if missing; default: the system temp dir)")
    p.add_argument("--plot", type=Path, default=None, help="write a PNG figure here")
    p.add_argument("--quick", action="store_true", help="small sizes, one round (checks the path; not for figures)")
    p.add_argument("--buffered", dest="direct", action="store_false", default=None,
                   help="concurrent engine writes through the page cache (default: O_DIRECT, HPCCKPT_DIRECT)")
    add_json(p)
    p.set_defaults(func=run)


def _fmt(v: Any, spec: str = ".2f") -> str:
    return "n/a" if v is None else format(v, spec)


def text(res: dict[str, Any]) -> str:
    lim, t = res["limits"], res["targets"]
    copies = (f"pinned D2H {lim['pinned_d2h_gbps']:.1f} GB/s, H2D {lim['pinned_h2d_gbps']:.1f} GB/s, "
              if res["device"] == "cuda" else "")
    lines = [f"{res['device']}: state {res['state_bytes'] / 1e9:.2f} GB; limits: raw parallel write "
             f"{lim['write_gbps']:.2f} GB/s (O_DIRECT+fdatasync; dd {lim['write_dd_gbps']:.2f}), read "
             f"{lim['read_gbps']:.2f} GB/s (cold), {copies}memcpy {lim['memcpy_gbps']:.2f} GB/s",
             f"{'engine':<11}{'stall s':>9}{'first s':>9}{'persist s':>11}{'GB/s':>7}{'load s':>9}{'GB/s':>7}"
             + "".join(f"{'ovh@' + i:>9}" for i in ("1", "10", "50"))]
    for name, e in res["engines"].items():
        ovh = res["overhead"].get(name, {})
        lines.append(f"{name:<11}{e['stall_s']:>9.4f}{e['first_stall_s']:>9.4f}{e['persist_s']:>11.3f}"
                     f"{e['persist_gbps']:>7.2f}{e['load_s']:>9.3f}{e['load_gbps']:>7.2f}"
                     + "".join(f"{100 * ovh.get(i, float('nan')):>8.1f}%" for i in ("1", "10", "50")))
    lines.append(f"stall vs sync {t['stall_vs_sync']:.3f} (<= {t['stall_vs_sync_target']}); snapshot vs "
                 f"{t['snapshot_copy_limit']} {t['snapshot_vs_copy_limit']:.2f} (>= 0.8); first vs steady save "
                 f"{t['first_vs_steady']:.2f} (<= 2); persist vs raw write {t['persist_vs_write']:.2f} (>= 0.85); "
                 f"load vs raw read {t['load_vs_read']:.2f} (>= 0.85)")
    if t["load_vs_torch_load"] is not None:
        lines.append(f"load vs torch.load {t['load_vs_torch_load']:.2f}x (>= {t['load_vs_torch_load_target']:g}); "
                     f"a raw read of the same bytes reaches {t['load_vs_torch_load_ceiling']:.2f}x"
                     + ("" if t["load_vs_torch_load_reachable"] else " (the disk itself cannot reach the target)"))
    staging = res.get("staging", {})
    if staging.get("supported"):
        lines.append("concurrent stall by staging budget: " + ", ".join(
            f"{100 * float(f):.0f}% {_fmt(v.get('stall_s'), '.4f')}s" for f, v in staging["fractions"].items()))
    small = res.get("small_state")
    if small:
        from ..bench.smallstate import summary
        lines.append(summary(small))
    lines.append("blocked fraction @10: " + ", ".join(f"{n} {100 * v:.1f}%" for n, v in t["overhead_blocked_at_10"].items())
                 + "; disk absorbs a checkpoint per interval: "
                 + ", ".join(f"@{i} {'yes' if ok else 'no'}" for i, ok in t["disk_absorbs"].items()))
    return "\n".join(lines)


def check_plot_path(path: Path) -> None:
    """Refuse a --plot the figure could not be written to, before minutes of measuring."""
    from ..errors import ConfigError
    parent = path.parent if str(path.parent) else Path(".")
    if path.is_dir() or not parent.is_dir():
        raise ConfigError(f"--plot {path}: give a file name in an existing directory (e.g. --plot bench.png)")


def run_ranks(args: argparse.Namespace) -> int:
    """``--ranks N``: the DDP job on 1 and N local ranks (``hpcckpt.bench.ranks``)."""
    import tempfile

    from ..bench import ranks
    from ..demo.runtime import resolve_device, work_dir
    from ..errors import ConfigError

    if args.plot is not None:
        raise ConfigError("--plot draws the single-process bench; drop --plot with --ranks (its result is a table)")
    if args.device.strip().lower() != "auto" and resolve_device(args.device) != "cpu":
        raise ConfigError(f"--device {args.device}: --ranks runs its ranks on the CPU (gloo); "
                          "drop --device or give --device cpu")
    directory = work_dir(args.dir) if args.dir is not None else None
    o = ranks.RanksOptions.make(ranks=args.ranks, size_gb=args.size_gb, dir=directory, quick=args.quick,
                                direct=args.direct)
    ranks.check_room(o, directory or Path(tempfile.gettempdir()))
    res = ranks.run_ranks(o, progress=lambda s: print(s, file=sys.stderr, flush=True))
    emit(args, res, ranks.text(res))
    return 0


def _one_mode(args: argparse.Namespace) -> None:
    from ..errors import ConfigError
    chosen = [f for f, on in (("--ranks", args.ranks is not None), ("--peers", args.peers),
                              ("--tensors", args.tensors is not None), ("--levels", args.levels),
                              ("--small-state", args.small_state is not None)) if on]
    if len(chosen) > 1:
        raise ConfigError(f"{' and '.join(chosen)}: give one of them per run (each is a bench of its own)")
    if args.mesh is not None and not args.peers:
        raise ConfigError(f"--mesh {args.mesh}: it shapes the sharded state of --peers; add --peers "
                          "(e.g. hpcckpt bench --peers --mesh 2x2)")
    if args.local_dir is not None and not args.levels:
        raise ConfigError(f"--local-dir {args.local_dir}: it names the node-local level of --levels; "
                          "add --levels (e.g. hpcckpt bench --levels --local-dir /dev/shm)")


def _room(size_bytes: int, directory: Path | None, *, option: str) -> None:
    """Every method's newest checkpoint on disk at once, plus one being written; in memory the
    state, a staged copy and what a restore builds."""
    import tempfile

    from ..bench import require_room
    require_room(directory or Path(tempfile.gettempdir()), size_bytes, disk_factor=8, memory_bytes=3 * size_bytes,
                 memory_what="the state, a staged copy and a restore", option=option)


def run_peers(args: argparse.Namespace) -> int:
    """``--peers`` (``hpcckpt.bench.peers``; with --mesh ``hpcckpt.bench.peers_sharded``) or ``--tensors``
    (``hpcckpt.bench.tensors``)."""
    if args.mesh is not None:
        from ..bench.peers_sharded import run_cli
        return run_cli(args, emit)
    from ..bench import peers, tensors
    from ..bench.plot import plot_peers
    from ..demo.runtime import resolve_device, work_dir

    device = resolve_device(args.device)
    if args.plot is not None:
        if args.tensors is not None:
            from ..errors import ConfigError
            raise ConfigError("--plot draws --peers and the default bench; drop --plot with --tensors (a table)")
        check_plot_path(args.plot)
    directory = work_dir(args.dir) if args.dir is not None else None
    say = lambda s: print(s, file=sys.stderr, flush=True)  # noqa: E731
    if args.tensors is not None:
        t = tensors.TensorsOptions.make(counts=args.tensors, size_gb=args.size_gb, device=device, dir=directory,
                                        quick=args.quick, direct=args.direct)
        _room(t.size_bytes, directory, option=f" --tensors {','.join(map(str, t.counts))}")
        res = tensors.run_tensors(t, progress=say)
        emit(args, res, tensors.text(res))
        return 0 if res["all_exact"] else 1
    o = peers.PeersOptions.make(size_gb=args.size_gb, device=device, dir=directory, quick=args.quick,
                                direct=args.direct)
    _room(o.size_bytes, directory, option=" --peers")
    res = peers.run_peers(o, progress=say)
    if args.plot:
        plot_peers(res, args.plot)
        res["plot"] = str(args.plot)
        say(f"hpcckpt bench: plot written to {args.plot}")
    emit(args, res, peers.text(res))
    return 0 if res["all_exact"] else 1


def run_levels(args: argparse.Namespace) -> int:
    """``--levels`` (``hpcckpt.bench.levels``)."""
    from ..bench import levels
    from ..demo.runtime import resolve_device, work_dir
    from ..errors import ConfigError

    if args.plot is not None:
        raise ConfigError("--plot draws --peers and the default bench; drop --plot with --levels (its result is a table)")
    if args.local_dir is not None and not str(args.local_dir).strip():
        raise ConfigError("--local-dir '': give a node-local directory (e.g. --local-dir /dev/shm)")
    device = resolve_device(args.device)
    directory = work_dir(args.dir) if args.dir is not None else None
    o = levels.LevelsOptions.make(size_gb=args.size_gb, dir=directory, local_dir=args.local_dir, quick=args.quick,
                                  direct=args.direct, device=device)
    res = levels.run_levels(o, progress=lambda s: print(s, file=sys.stderr, flush=True))
    emit(args, res, levels.text(res))
    return 0


def run_small(args: argparse.Namespace) -> int:
    """``--small-state [MB,MS]`` (``hpcckpt.bench.smallstate``)."""
    import shutil
    import tempfile

    from ..bench.smallstate import measure_small_state, parse_small, summary
    from ..demo.runtime import resolve_device, work_dir
    from ..errors import ConfigError

    if args.plot is not None:
        raise ConfigError("--plot draws --peers and the default bench; drop --plot with --small-state (a table)")
    if args.size_gb is not None:
        raise ConfigError(f"--size-gb {args.size_gb:g} with --small-state: the small state's size is the MB of "
                          "--small-state MB,MS (e.g. --small-state 1.4,19)")
    state_bytes, step_s = parse_small(args.small_state)
    device = resolve_device(args.device)
    directory = work_dir(args.dir) if args.dir is not None else None
    base = Path(tempfile.mkdtemp(prefix="hpcckpt-bench-small-", dir=directory))
    options = {"direct": args.direct}
    try:
        res = measure_small_state(base, options, quick=args.quick, device=device, state_bytes=state_bytes,
                                  step_s=step_s)
    finally:
        shutil.rmtree(base, ignore_errors=True)
    emit(args, res, summary(res))
    return 0


def run(args: argparse.Namespace) -> int:
    _one_mode(args)
    if args.small_state is not None:
        return run_small(args)
    if args.ranks is not None:
        return run_ranks(args)
    if args.levels:
        return run_levels(args)
    if args.peers or args.tensors is not None:
        return run_peers(args)
    from ..bench import BenchOptions, check_room, run_bench
    from ..bench.plot import plot_bench
    from ..demo.runtime import resolve_device, work_dir

    device = resolve_device(args.device)
    if args.plot is not None:
        check_plot_path(args.plot)
    directory = work_dir(args.dir) if args.dir is not None else None
    o = BenchOptions.make(size_gb=args.size_gb, dir=directory, quick=args.quick, direct=args.direct, device=device)
    import tempfile
    check_room(o, directory or Path(tempfile.gettempdir()))
    res = run_bench(o, progress=lambda s: print(s, file=sys.stderr, flush=True))
    if args.plot:
        plot_bench(res, args.plot)
        res["plot"] = str(args.plot)
        print(f"hpcckpt bench: plot written to {args.plot}", file=sys.stderr)
    emit(args, res, text(res))
    return 0
