"""``hpcckpt bench --peers --mesh DPxTP``: DCP and hpcckpt on the same 2-D sharded state.

``DP x TP`` local ranks (gloo over 127.0.0.1, CPU, one torch thread each) build the same
FSDP2 x tensor-parallel model as torchtitan-style scripts do: a ``(dp, tp)`` device mesh,
a two-layer MLP (``IN -> hidden -> OUT``) with ``ColwiseParallel`` then
``RowwiseParallel`` on ``tp`` (``parallelize_module``), ``fully_shard`` on ``dp``, AdamW.
The hidden width is chosen so that parameters and AdamW's two moments hold ``--size-gb``
of state, and so that its FSDP shards are uneven (``hidden % 4 == 2``, as in
tests/integration/test_fsdp_tp.py). On a 2x2 mesh the first layer's tensors are placed
``(_StridedShard(0), Shard(0))``, the second's weight ``(Shard(0), Shard(1))`` and its bias
``(Shard(0), Replicate())``: every shard layout the pair produces is in the state.

Methods, side by side in one run on that state, each on a model built afresh from the
same seed and trained one warm-up step:

- ``dcp_save``: ``dcp.save(get_state_dict(model, opt))`` (blocking, all ranks);
- ``dcp_async``: ``dcp.async_save`` of the same, on a gloo process group of its own (DCP's
  advice: the background collectives stay off training's group), one in flight;
- ``hpcckpt_sync`` / ``hpcckpt_concurrent``: ``Checkpointer(engine=...)`` with the model
  and optimizer registered, ``save()`` at the step boundary.

Per round (the method order rotates by round) each method takes a first save and then
``repeats`` steady ones, in the loop ``forward/backward -> save -> forward/backward ->
optimizer.step`` (as ``bench --peers``): ``stall_s`` is the save call plus what the next
``optimizer.step`` waited for (the concurrent engine's pre-hook), ``persist_s`` the save
call to durable (DCP: ``dcp.save`` returning, or async_save's future; hpcckpt: the
engine's commit), both the slowest rank's, median over saves. Then every method's newest
checkpoint is restored after the page cache is dropped (``drop_caches`` as root, else
``posix_fadvise(DONTNEED)`` on its files) into a model built afresh with other values
(another seed per rank) in the same ranks: DCP by ``get_state_dict`` + ``dcp.load`` +
``set_state_dict`` (the user's code), hpcckpt by a new ``Checkpointer``'s
``register(model=, optimizer=)``; ``restore_s`` is the slowest rank's. ``restore_exact``:
on every rank, sha256 of every local shard (model tensors and optimizer state, by
parameter name) equals the one taken of the state as it was saved. ``written_bytes``: the
bytes of the checkpoint's files, against the state's global bytes (``written_vs_state``);
``save_capture_s`` (hpcckpt): the part of the save call that captured the state
(``state_dict()`` and co.), the rest being the engine's ``save()``.

One process per rank for the whole run: the restores are cold on disk, not in a fresh
process (a fresh world costs ~10 s of imports per rank on a small machine); peak RSS is not
measured here (``bench --peers`` on one process measures it).
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..errors import ConfigError
from .limits import GB
from .rankproc import leave

METHODS = {"dcp_save": "torch.distributed.checkpoint.save (blocking)",
           "dcp_async": "DCP async_save, thread, on a gloo group of its own, one in flight",
           "hpcckpt_sync": "hpcckpt Checkpointer, engine sync",
           "hpcckpt_concurrent": "hpcckpt Checkpointer, engine concurrent"}
DEFAULT_GB, QUICK_GB = 0.256, 0.016
IN, OUT, ROWS = 256, 256, 16
_FP32, _ADAM_COPIES = 4, 3
Tick = Callable[[str], None]


def parse_mesh(raw: str) -> tuple[int, int]:
    """``--mesh DPxTP`` -> (dp, tp): whole numbers >= 1 whose product is 2 or more."""
    parts = raw.lower().split("x")
    try:
        dp, tp = (int(x) for x in parts)
    except ValueError:
        raise ConfigError(f"--mesh {raw!r}: give the device mesh as DPxTP, e.g. --mesh 2x2 (FSDP2 over 2 x "
                          "tensor parallel over 2: 4 local ranks)") from None
    if dp < 1 or tp < 1 or dp * tp < 2:
        raise ConfigError(f"--mesh {raw!r}: DP and TP are 1 or more and DP x TP (the local ranks) 2 or more, "
                          "e.g. --mesh 2x2")
    if dp * tp > 16:
        raise ConfigError(f"--mesh {raw!r}: {dp * tp} local ranks on one machine; give 16 or fewer (e.g. --mesh 2x2)")
    return dp, tp


def hidden_for(size_bytes: int) -> int:
    """The hidden width whose parameters and AdamW moments hold about ``size_bytes``; ``% 4 == 2``
    (FSDP's shards of each TP half uneven)."""
    params = size_bytes // (_FP32 * _ADAM_COPIES)
    h = max(6, (params - OUT) // (IN + OUT + 1))
    return h - (h - 2) % 4


@dataclass(frozen=True, kw_only=True)
class ShardedOptions:
    dp: int = 2
    tp: int = 2
    size_bytes: int = int(DEFAULT_GB * GB)
    dir: Path | None = None
    quick: bool = False
    rounds: int = 3
    repeats: int = 3
    direct: bool | None = None

    @property
    def world(self) -> int:
        return self.dp * self.tp

    @staticmethod
    def make(*, mesh: str, size_gb: float | None, dir: Path | None, quick: bool,
             direct: bool | None = None) -> ShardedOptions:
        from . import check_size_gb
        dp, tp = parse_mesh(mesh)
        size = int((check_size_gb(size_gb) or (QUICK_GB if quick else DEFAULT_GB)) * GB)
        if quick:
            return ShardedOptions(dp=dp, tp=tp, size_bytes=size, dir=dir, quick=True, rounds=1, repeats=2,
                                  direct=direct)
        return ShardedOptions(dp=dp, tp=tp, size_bytes=size, dir=dir, direct=direct)


# -- in the ranks ------------------------------------------------------------------------

def build(dp: int, tp: int, hidden: int, seed: int) -> tuple[Any, Any]:
    """The FSDP2 x TP MLP and its AdamW (as tests/integration/fsdp_tp_train.py builds it)."""
    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(IN, hidden), torch.nn.ReLU(), torch.nn.Linear(hidden, OUT))
    mesh = init_device_mesh("cpu", (dp, tp), mesh_dim_names=("dp", "tp"))
    if tp > 1:
        parallelize_module(model, mesh["tp"], {"0": ColwiseParallel(), "2": RowwiseParallel()})
    if dp > 1:
        fully_shard(model, mesh=mesh["dp"])
    return model, torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1)


class Rig:
    """One rank's model + AdamW and its training step (every rank the same batches)."""

    def __init__(self, a: argparse.Namespace, seed: int) -> None:
        self.model, self.opt = build(a.dp, a.tp, a.hidden, seed)
        self.n = 0
        self.forward_backward()
        self.opt.step()  # AdamW's moments exist: the state has its full size

    def forward_backward(self) -> None:
        import torch
        g = torch.Generator().manual_seed(1000 + self.n)
        self.n += 1
        x, y = torch.randn(ROWS, IN, generator=g), torch.randn(ROWS, OUT, generator=g)
        self.opt.zero_grad()
        torch.nn.functional.mse_loss(self.model(x), y).backward()


def _local(t: Any) -> Any:
    from torch.distributed.tensor import DTensor
    return t.to_local() if isinstance(t, DTensor) else t


def digest(rig: Rig) -> str:
    """sha256 of this rank's shards: every model tensor, every optimizer state value, by name."""
    import torch
    h = hashlib.sha256()

    def feed(name: str, t: Any) -> None:
        t = _local(t).detach().contiguous()
        h.update(f"{name}|{t.dtype}|{tuple(t.shape)}|".encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy())

    for name, t in sorted(rig.model.state_dict().items()):
        feed(f"model/{name}", t)
    names = {id(p): n for n, p in rig.model.named_parameters()}
    for group in rig.opt.param_groups:
        for p in group["params"]:
            for key, v in sorted(rig.opt.state.get(p, {}).items()):
                if isinstance(v, torch.Tensor):
                    feed(f"optim/{names[id(p)]}/{key}", v)
    return h.hexdigest()


def global_bytes(rig: Rig) -> tuple[int, int, dict[str, str]]:
    """(bytes of the global state, its tensor count, each parameter's placements)."""
    import torch
    tensors = list(rig.model.state_dict().values())
    tensors += [v for st in rig.opt.state.values() for v in st.values() if isinstance(v, torch.Tensor)]
    total = sum(t.numel() * t.element_size() for t in tensors)  # a DTensor's numel is its global one
    placements = {n: str(tuple(getattr(p, "placements", ()))) for n, p in rig.model.named_parameters()}
    return total, len(tensors), placements


class _Pending:
    def __init__(self, t0: float, path: Path) -> None:
        self.t0, self.path = t0, path
        self.done_at: float | None = None
        self.waiter: Any = None
        self.capture_s: float | None = None  # hpcckpt: the state's capture (state_dict() and co.) inside the call


class DcpMethod:
    """``dcp.save`` or ``dcp.async_save`` (a gloo group of its own for the background part)."""

    def __init__(self, name: str, root: Path, rig: Rig) -> None:
        import torch.distributed as dist
        self.name, self.root, self.rig = name, root, rig
        self.group = dist.new_group(backend="gloo") if name == "dcp_async" else None

    def _state(self) -> dict[str, Any]:
        from torch.distributed.checkpoint.state_dict import get_state_dict
        msd, osd = get_state_dict(self.rig.model, self.rig.opt)
        return {"model": msd, "optim": osd}

    def start(self, step: int) -> _Pending:
        import torch.distributed.checkpoint as dcp
        t0 = time.perf_counter()
        p = _Pending(t0, self.root / f"step-{step}")
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            if self.group is None:
                dcp.save(self._state(), checkpoint_id=str(p.path))
                p.done_at = time.perf_counter()
            else:
                fut: Any = dcp.async_save(self._state(), checkpoint_id=str(p.path), process_group=self.group)
                fut.add_done_callback(lambda _f: setattr(p, "done_at", time.perf_counter()))
                p.waiter = fut.result
        return p

    def persist_s(self, p: _Pending) -> float:
        if p.waiter is not None:
            p.waiter()
            p.waiter = None
        if p.done_at is None:
            p.done_at = time.perf_counter()
        for old in self.root.iterdir():  # the newest stays for the restore
            if old != p.path:
                shutil.rmtree(old, ignore_errors=True)
        return p.done_at - p.t0

    def hook_wait_s(self) -> float:
        return 0.0

    def close(self) -> None:
        pass


class HpcckptMethod:
    """A ``Checkpointer`` with the model and optimizer registered, saving at the step boundary."""

    def __init__(self, name: str, root: Path, rig: Rig, direct: bool | None) -> None:
        from ..api import Checkpointer
        self.name, self.root, self.rig = name, root, rig
        self.engine = name.removeprefix("hpcckpt_")
        self.extra: dict[str, Any] = {} if direct is None else {"direct": direct}
        self.ck = Checkpointer(root, engine=self.engine, every_steps=None, keep=1, **self.extra)
        self.ck.register(model=rig.model, optimizer=rig.opt)
        if hasattr(self.ck.engine, "wait_prepared"):
            self.ck.engine.wait_prepared()  # a real loop keeps training while staging is laid out

    def start(self, step: int) -> _Pending:
        t0 = time.perf_counter()
        self.ck.step = step
        handle = self.ck.save()
        p = _Pending(t0, self.root)
        p.capture_s = float(getattr(handle, "capture_s", 0.0) or 0.0)

        def wait() -> None:
            handle.wait()
            # the engine's own clock (from its save() to the durable commit) after the state's capture
            p.done_at = (t0 + getattr(handle, "capture_s", 0.0) + handle.save_s if handle.save_s
                         else time.perf_counter())
        p.waiter = wait
        return p

    def persist_s(self, p: _Pending) -> float:
        if p.waiter is not None:
            p.waiter()
            p.waiter = None
        assert p.done_at is not None
        return p.done_at - p.t0

    def hook_wait_s(self) -> float:
        return float(getattr(getattr(self.ck.engine, "stats", None), "hook_wait_s", 0.0))

    def close(self) -> None:
        self.ck.close()


def make(name: str, root: Path, rig: Rig, direct: bool | None) -> Any:
    root.mkdir(parents=True, exist_ok=True)
    return DcpMethod(name, root, rig) if name.startswith("dcp") else HpcckptMethod(name, root, rig, direct)


def restore(name: str, rig: Rig, path: Path, direct: bool | None) -> None:
    """Read ``name``'s checkpoint at ``path`` into ``rig`` (built afresh), as its users do."""
    if name.startswith("dcp"):
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            msd, osd = get_state_dict(rig.model, rig.opt)  # a fresh AdamW's state laid out first, as DCP documents
            dcp.load({"model": msd, "optim": osd}, checkpoint_id=str(path))  # in place
            set_state_dict(rig.model, rig.opt, model_state_dict=msd, optim_state_dict=osd)
        return
    from ..api import Checkpointer
    ck = Checkpointer(path, engine=name.removeprefix("hpcckpt_"), every_steps=None, keep=1,
                      **({} if direct is None else {"direct": direct}))  # type: ignore[arg-type]
    try:
        if ck.register(model=rig.model, optimizer=rig.opt) is None:
            raise RuntimeError(f"{name}: no checkpoint restored from {path}")
    finally:
        ck.close()


def one_checkpoint(m: Any, rig: Rig, step: int, *, with_digest: bool) -> dict[str, Any]:
    """One save inside a training step (``bench --peers``'s ``one_checkpoint`` on the CPU)."""
    rig.forward_backward()
    saved = digest(rig) if with_digest else None  # the state as it is saved (untimed)
    hook0 = m.hook_wait_s()
    t0 = time.perf_counter()
    pending = m.start(step)
    call_s = time.perf_counter() - t0
    rig.forward_backward()
    rig.opt.step()  # the concurrent engine's pre-hook waits here for what it still needs
    wait_s = m.hook_wait_s() - hook0
    persist_s = m.persist_s(pending)
    return {"stall_s": call_s + wait_s, "call_s": call_s, "wait_s": wait_s, "persist_s": persist_s,
            "capture_s": pending.capture_s, "digest": saved, "path": str(pending.path)}


def rank_main(a: argparse.Namespace) -> dict[str, Any]:
    import torch.distributed as dist

    from .limits import drop_caches
    names = list(METHODS)
    out: dict[str, Any] = {"rank": a.rank, "methods": {n: {"rounds": []} for n in names}}
    t_start = time.monotonic()

    def say(s: str) -> None:
        if a.rank == 0:
            print(f"[rank 0 {time.monotonic() - t_start:6.1f}s] {s}", file=sys.stderr, flush=True)
    for r in range(a.rounds):
        k = r % len(names)
        order = names[k:] + names[:k]
        saved: dict[str, dict[str, Any]] = {}
        for name in order:
            root = a.dir / name
            if a.rank == 0:
                shutil.rmtree(root, ignore_errors=True)
            dist.barrier()
            rig = Rig(a, seed=0)
            if r == 0 and name == order[0]:
                out["state_bytes"], out["tensors"], out["placements"] = global_bytes(rig)
            m = make(name, root, rig, a.direct)
            try:
                first = one_checkpoint(m, rig, 1, with_digest=False)
                runs = [one_checkpoint(m, rig, 2 + i, with_digest=i == a.repeats - 1) for i in range(a.repeats)]
            finally:
                m.close()
            dist.barrier()
            saved[name] = {"first": first, "runs": runs, "path": runs[-1]["path"], "digest": runs[-1]["digest"]}
            say(f"round {r}: {name} saved")
        for name in order:
            path = Path(saved[name]["path"])
            cold = ""
            if a.rank == 0:
                cold = drop_caches([path])
                saved[name]["written_bytes"] = sum(f.stat().st_size for f in path.rglob("*") if f.is_file())
            rig = Rig(a, seed=1000 + a.rank)  # other values on every rank: a restore that misses a shard shows
            dist.barrier()
            t0 = time.perf_counter()
            restore(name, rig, path, a.direct)
            restore_s = time.perf_counter() - t0
            dist.barrier()
            saved[name].update(restore_s=restore_s, exact=digest(rig) == saved[name]["digest"], cold_cache=cold)
            say(f"round {r}: {name} restored in {restore_s:.3f}s")
        for name in names:
            row = {k: v for k, v in saved[name].items() if k not in ("digest",)}
            out["methods"][name]["rounds"].append(row)
        if a.rank == 0:
            for name in names:
                shutil.rmtree(a.dir / name, ignore_errors=True)
        dist.barrier()
    return out


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m hpcckpt.bench.peers_sharded")
    p.add_argument("--rank", type=int, required=True)
    p.add_argument("--dp", type=int, required=True)
    p.add_argument("--tp", type=int, required=True)
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--dir", type=Path, required=True)
    p.add_argument("--hidden", type=int, required=True)
    p.add_argument("--rounds", type=int, required=True)
    p.add_argument("--repeats", type=int, required=True)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--direct", choices=("0", "1"), default=None)
    a = p.parse_args(argv)
    a.direct = None if a.direct is None else a.direct == "1"
    return a


def main(argv: list[str] | None = None) -> int:
    a = parse(argv)
    import torch
    import torch.distributed as dist
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{a.port}", rank=a.rank,
                            world_size=a.dp * a.tp)
    leave(a.out, rank_main(a))
    return 0


# -- in the parent -----------------------------------------------------------------------

def method_figures(results: list[dict[str, Any]], name: str, nbytes: int) -> dict[str, Any]:
    """The slowest rank's figures per save and restore, their medians, exactness over every rank."""
    rounds = [res["methods"][name]["rounds"] for res in results]
    n_rounds = len(rounds[0])

    def per_save(key: str) -> list[float]:
        return [max(col) for col in zip(*[[x[key] for rnd in rr for x in rnd["runs"]] for rr in rounds])]

    stalls, persists = per_save("stall_s"), per_save("persist_s")
    restores = [max(rr[i]["restore_s"] for rr in rounds) for i in range(n_rounds)]
    first = [max(rr[i]["first"]["stall_s"] for rr in rounds) for i in range(n_rounds)]
    written = [rounds[0][i]["written_bytes"] for i in range(n_rounds)]
    out: dict[str, Any] = {
        "what": METHODS[name],
        "stall_s": statistics.median(stalls), "stall_all_s": stalls,
        "save_call_s": statistics.median(per_save("call_s")),
        "wait_before_step_s": statistics.median(per_save("wait_s")),
        "first_stall_s": statistics.median(first),
        "persist_s": statistics.median(persists), "persist_all_s": persists,
        "restore_s": statistics.median(restores), "restore_all_s": restores,
        "restore_exact": all(rr[i]["exact"] for rr in rounds for i in range(n_rounds)),
        "exact_ranks": [all(rr[i]["exact"] for i in range(n_rounds)) for rr in rounds],
        "written_bytes": statistics.median(written),
    }
    if all(x["capture_s"] is not None for rr in rounds for rnd in rr for x in rnd["runs"]):
        out["save_capture_s"] = statistics.median(per_save("capture_s"))  # hpcckpt: capture within the call
    out["persist_gbps"] = nbytes / out["persist_s"] / GB if out["persist_s"] > 0 else None
    out["restore_gbps"] = nbytes / out["restore_s"] / GB if out["restore_s"] > 0 else None
    out["written_vs_state"] = out["written_bytes"] / nbytes
    return out


def _vs_dcp(methods: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """Each hpcckpt engine against dcp.save and dcp.async_save: stall, persist, restore ratios."""
    out: dict[str, Any] = {}
    for ref in ("dcp_save", "dcp_async"):
        r = methods[ref]
        out[ref] = {n: {k: (m[f"{k}_s"] / r[f"{k}_s"] if r[f"{k}_s"] > 0 else None)
                        for k in ("stall", "persist", "restore")}
                    for n, m in methods.items() if n.startswith("hpcckpt")}
    return out


def check_torch() -> None:
    """FSDP2, tensor parallelism and DCP as this bench uses them, or a ConfigError saying what is missing."""
    try:
        import torch.distributed.checkpoint.state_dict  # noqa: F401
        from torch.distributed.fsdp import fully_shard  # noqa: F401
        from torch.distributed.tensor.parallel import parallelize_module  # noqa: F401
    except ImportError as exc:
        import torch
        raise ConfigError(f"--peers --mesh: torch {torch.__version__} lacks what the sharded state needs ({exc}); "
                          "it needs torch with FSDP2 (torch.distributed.fsdp.fully_shard, 2.6 or newer), or drop "
                          "--mesh for the one-process --peers") from None


def run_sharded(o: ShardedOptions, progress: Tick = lambda s: None) -> dict[str, Any]:
    """Start the ranks, collect their figures (see the module docstring)."""
    import torch

    from ..demo.runtime import module_cmd
    from .ranks import free_port, rank_env, run_procs
    check_torch()
    base = Path(tempfile.mkdtemp(prefix="hpcckpt-peers-mesh-", dir=o.dir))
    hidden = hidden_for(o.size_bytes)
    t0 = time.monotonic()
    progress(f"[peers --mesh {o.dp}x{o.tp}] {o.world} local ranks (gloo, CPU), FSDP2 x TP MLP {IN}->{hidden}->{OUT} "
             f"+ AdamW (~{o.size_bytes / GB:.3f} GB), {len(METHODS)} methods, {o.rounds} round(s) of 1 + "
             f"{o.repeats} saves each; files under {base}")
    try:
        port = free_port()
        direct = [] if o.direct is None else ["--direct", "1" if o.direct else "0"]
        cmds = [[*module_cmd("hpcckpt.bench.peers_sharded"), "--rank", str(r), "--dp", str(o.dp), "--tp", str(o.tp),
                 "--port", str(port), "--dir", str(base / "ckpt"), "--hidden", str(hidden), "--rounds", str(o.rounds),
                 "--repeats", str(o.repeats), "--out", str(base / f"result-r{r}.json"), *direct]
                for r in range(o.world)]
        logs = [base / f"log-r{r}.txt" for r in range(o.world)]
        run_procs(cmds, logs, what=f"peers on a {o.dp}x{o.tp} mesh", env=rank_env(),
                  timeout_s=600 + 1200 * o.size_bytes / GB)
        results = [json.loads((base / f"result-r{r}.json").read_text()) for r in range(o.world)]
        for line in logs[0].read_text(errors="replace").splitlines():
            if line.startswith("[rank 0"):
                progress(f"[peers --mesh] {line}")
    finally:
        shutil.rmtree(base, ignore_errors=True)
    nbytes = int(results[0]["state_bytes"])
    methods = {n: method_figures(results, n, nbytes) for n in METHODS}
    cold = {x["cold_cache"] for rnd in results[0]["methods"]["dcp_save"]["rounds"] for x in [rnd]}
    return {
        "kind": "peers_sharded", "device": "cpu", "mesh": f"{o.dp}x{o.tp}", "world": o.world,
        "model": {"in": IN, "hidden": hidden, "out": OUT, "rows": ROWS, "placements": results[0]["placements"]},
        "state_bytes": nbytes, "tensors": results[0]["tensors"], "methods": methods,
        "all_exact": all(m["restore_exact"] for m in methods.values()),
        "cold_cache": ",".join(sorted(c for c in cold if c)), "vs_dcp": _vs_dcp(methods),
        "machine": {"cpus": os.cpu_count(), "torch": torch.__version__, "dir": str(o.dir or tempfile.gettempdir())},
        "options": {"quick": o.quick, "rounds": o.rounds, "repeats": o.repeats, "size_bytes": o.size_bytes,
                    "direct": o.direct, "torch_threads_per_rank": 1},
        "wall_s": time.monotonic() - t0,
    }


def text(res: dict[str, Any]) -> str:
    """The result as a table (``--json`` prints the tree instead)."""
    lines = [f"{res['mesh']} mesh, {res['world']} local ranks (gloo, CPU): FSDP2 x TP MLP "
             f"{res['model']['in']}->{res['model']['hidden']}->{res['model']['out']} + AdamW, "
             f"{res['state_bytes'] / GB:.3f} GB of state over {res['tensors']} tensors; the slowest rank's figures, "
             f"median of {res['options']['rounds']} round(s) x {res['options']['repeats']} saves; "
             f"cold cache by {res['cold_cache']}",
             f"{'method':<20}{'stall s':>9}{'first s':>9}{'persist s':>10}{'GB/s':>7}{'restore s':>10}{'GB/s':>7}"
             f"{'exact':>6}{'written':>9}"]
    for n, m in res["methods"].items():
        lines.append(f"{n:<20}{m['stall_s']:>9.4f}{m['first_stall_s']:>9.4f}{m['persist_s']:>10.3f}"
                     f"{m['persist_gbps'] or 0:>7.2f}{m['restore_s']:>10.3f}{m['restore_gbps'] or 0:>7.2f}"
                     f"{'yes' if m['restore_exact'] else 'NO':>6}{m['written_vs_state']:>8.2f}x")
    for n, m in res["methods"].items():
        if "save_capture_s" in m:
            lines.append(f"{n}: of its save() call ({m['save_call_s']:.4f} s), the state's capture (state_dict() "
                         f"and co.) {m['save_capture_s']:.4f} s, the engine's save() the rest")
    for ref, per in res["vs_dcp"].items():
        lines.append(f"vs {ref}: " + "; ".join(
            f"{n} stall {v['stall']:.2f}x, persist {v['persist']:.2f}x, restore {v['restore']:.2f}x"
            for n, v in per.items() if None not in v.values()))
    if not res["all_exact"]:
        lines.append("a restore was NOT exact: see restore_exact and exact_ranks per method")
    return "\n".join(lines)


def run_cli(args: argparse.Namespace, emit: Callable[[argparse.Namespace, Any, str], None]) -> int:
    """``hpcckpt bench --peers --mesh DPxTP``: check the options, run, print (``emit``); 1 if a restore was
    not exact."""
    from ..demo.runtime import resolve_device, work_dir
    from . import require_room

    if args.plot is not None:
        raise ConfigError("--plot draws --peers and the default bench; drop --plot with --mesh (a table)")
    if args.tensors is not None:
        raise ConfigError(f"--mesh {args.mesh} and --tensors: give one of them per run (--mesh shapes --peers' "
                          "sharded state, --tensors its one-process sweep)")
    if args.device.strip().lower() != "auto" and resolve_device(args.device) != "cpu":
        raise ConfigError(f"--device {args.device}: --peers --mesh runs its ranks on the CPU (gloo); "
                          "drop --device or give --device cpu")
    directory = work_dir(args.dir) if args.dir is not None else None
    o = ShardedOptions.make(mesh=args.mesh, size_gb=args.size_gb, dir=directory, quick=args.quick,
                            direct=args.direct)
    require_room(directory or Path(tempfile.gettempdir()), o.size_bytes, disk_factor=6, memory_bytes=4 * o.size_bytes,
                 memory_what="the state over the ranks, a staged copy, DCP's copies and a restore",
                 option=f" --peers --mesh {args.mesh}")
    res = run_sharded(o, progress=lambda s: print(s, file=sys.stderr, flush=True))
    emit(args, res, text(res))
    return 0 if res["all_exact"] else 1


if __name__ == "__main__":
    sys.exit(main())
