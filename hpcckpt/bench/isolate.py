"""Measurements in a process of their own, without paying the imports each time.

A forkserver (``multiprocessing``) imports torch, DCP and hpcckpt once, before any
thread or CUDA context exists; every measurement then runs in a child forked from it:
its own heap (a restore lands in memory the process never touched, as a resumed job's
does), its own CUDA context, and its own peak RSS. A fresh interpreter per measurement
costs ~3 s of CPU for the imports alone (the cold loads of ``bench --quick`` spent most
of their time there); a fork costs milliseconds.

Peak RSS: the child resets the kernel's high-water mark (``/proc/self/clear_refs`` 5)
and reads ``VmHWM`` at the end; where that is refused it falls back to ``ru_maxrss``.
``rss_base_bytes`` is the RSS at the start (the imports), so ``peak - base`` is what
the measurement itself held. That includes what a fresh torch process allocates on
first use (measured: 60-80 MB on the CPU with a 2-16 MB state), so per byte of state
it means something from hundreds of MB of state up, not for --quick's tiny states.
"""
from __future__ import annotations

import multiprocessing
import os
import resource
import traceback
from collections.abc import Callable
from typing import Any

from ..errors import HpcckptError

PRELOAD = ["torch", "torch.distributed.checkpoint", "torch.distributed.checkpoint.state_dict",
           "torch.distributed.checkpoint.staging", "torch.distributed.checkpoint.state_dict_saver", "hpcckpt.bench.methods", "hpcckpt.bench.peers", "hpcckpt.bench.tensors", "hpcckpt.bench.smallstate",
           "hpcckpt.bench.loadproc", "hpcckpt.bench", "hpcckpt.bench.synthetic",
           "hpcckpt.engines", "hpcckpt.store.read", "hpcckpt.store.catalog", "hpcckpt._native"]
_ctx: Any = None
_children_cpu_s = [0.0]  # CPU seconds of every child so far (user + system, theirs and their own children's)


def children_cpu_s() -> float:
    """CPU seconds the isolated children of this process have used so far."""
    return _children_cpu_s[0]


def _context() -> Any:
    global _ctx
    if _ctx is None:
        _ctx = multiprocessing.get_context("forkserver")
        _ctx.set_forkserver_preload(PRELOAD)
    return _ctx


def rss_bytes() -> int:
    """This process's resident set now."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def reset_peak() -> str:
    """Reset the peak-RSS mark; returns how peaks are read ("VmHWM" or "ru_maxrss")."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return "VmHWM"
    except OSError:
        return "ru_maxrss"


def peak_bytes(how: str) -> int:
    if how == "VmHWM":
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _child(conn: Any, fn: Callable[..., dict[str, Any]], args: tuple[Any, ...]) -> None:
    how = reset_peak()
    base = rss_bytes()
    try:
        out = fn(*args)
        out["rss"] = {"base_bytes": base, "peak_bytes": peak_bytes(how), "peak_from": how}
        out["cpu_s"] = sum(getattr(resource.getrusage(who), f) for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN)
                           for f in ("ru_utime", "ru_stime"))
        conn.send(("ok", out))
    except BaseException as exc:  # reported to the parent, which raises it with the child's traceback
        conn.send(("error", f"{type(exc).__name__}: {exc}\n{traceback.format_exc()[-3000:]}"))
    finally:
        conn.close()


def run_isolated(fn: Callable[..., dict[str, Any]], *args: Any, timeout_s: float = 1800.0) -> dict[str, Any]:
    """``fn(*args)`` in a child forked from the forkserver; its dict plus ``rss``.

    ``fn`` must be a module-level function and ``args`` picklable. A child that fails or
    dies raises ``HpcckptError`` naming the function and the child's own error.
    """
    ctx = _context()
    recv, send = ctx.Pipe(duplex=False)
    proc = ctx.Process(target=_child, args=(send, fn, args))  # not daemonic: DCP may start its own
    proc.start()
    send.close()
    try:
        if not recv.poll(timeout_s):
            proc.kill()
            raise HpcckptError(f"bench: {fn.__name__} did not finish within {timeout_s:.0f} s")
        status, payload = recv.recv()
    except EOFError:
        status, payload = "error", "the child exited without a result"
    finally:
        recv.close()
        proc.join(60)
        if proc.is_alive():  # a result came but the child hangs on exit (a helper process of its own)
            proc.kill()
            proc.join()
    if status == "ok":
        _children_cpu_s[0] += float(payload.get("cpu_s", 0.0))
    if status != "ok":
        raise HpcckptError(f"bench: {fn.__name__}{args!r:.200} failed in its child process "
                           f"(exit {proc.exitcode}): {payload}")
    return payload


def held_vs_state(rss: dict[str, Any], state_bytes: int) -> float:
    """What a measurement held at its peak, beyond its start, per byte of state."""
    return (int(rss["peak_bytes"]) - int(rss["base_bytes"])) / max(1, state_bytes)
