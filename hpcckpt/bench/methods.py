"""The ways to checkpoint that ``bench --peers`` and ``--tensors`` put side by side.

Each method saves the same ``PeerRig`` (a model + AdamW) and restores it into a freshly
built one. Call sequence of a ``Method`` (one process, main thread)::

    m = make_method(name, root, rig, options)
    pending = m.start(step)        # the blocking part of a save, at a step boundary
    m.before_step(pending)         # waits the next optimizer.step() must make (DCP staging)
    m.persist_s(pending)           # waits until durable; seconds since start()
    m.close()

hpcckpt's concurrent engine waits in its own optimizer pre-hook instead of
``before_step``; ``hook_wait_s()`` reads that. Durable means: torch.save + fsync of the
file and its directory; DCP's own ``sync_files=True`` (every data file and the
metadata fsynced; DCP does not fsync the directory); hpcckpt's commit protocol.
``restore(name, path, rig)`` reads a checkpoint into a fresh rig; ``state_digest``
is what "exact" is checked against.
"""
from __future__ import annotations

import hashlib
import os
import shutil
import time
import warnings
from pathlib import Path
from typing import Any

import torch

from ..store.commit import fsync_path
from .synthetic import PeerRig

HPCCKPT = {"hpcckpt_sync": "sync", "hpcckpt_concurrent": "concurrent"}
DCP_ASYNC = ("dcp_async", "dcp_async_process", "dcp_async_staged")
ALL = ("torch_save", "dcp_save", *DCP_ASYNC, *HPCCKPT)


def available(device: str) -> tuple[dict[str, str], dict[str, str]]:
    """({method: what it is}, {method: why it is left out}) for the installed torch."""
    try:
        from torch.distributed.checkpoint import state_dict_saver as saver
    except ImportError as exc:
        why = f"torch.distributed.checkpoint does not import ({exc})"
        return _describe(["torch_save", *HPCCKPT], device), {n: why for n in ("dcp_save", *DCP_ASYNC)}
    names = ["torch_save", "dcp_save", "dcp_async"]
    skipped: dict[str, str] = {}
    kinds = getattr(saver, "AsyncCheckpointerType", None)
    if kinds is not None and hasattr(kinds, "PROCESS"):
        names.append("dcp_async_process")
    else:
        skipped["dcp_async_process"] = f"torch {torch.__version__} has no AsyncCheckpointerType.PROCESS"
    try:
        from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions  # noqa: F401
        names.append("dcp_async_staged")
    except ImportError:
        skipped["dcp_async_staged"] = f"torch {torch.__version__} has no staging.DefaultStager"
    return _describe([*names, *HPCCKPT], device), skipped


def _describe(names: list[str], device: str) -> dict[str, str]:
    pinned = "pinned" if device == "cuda" else "pageable (no GPU)"
    text = {"torch_save": "torch.save + fsync (file and directory)",
            "dcp_save": "torch.distributed.checkpoint.save",
            "dcp_async": "DCP async_save, thread, staging in the call",
            "dcp_async_process": "DCP async_save, AsyncCheckpointerType.PROCESS (a checkpoint daemon process)",
            "dcp_async_staged": f"DCP async_save, thread, DefaultStager with async staging into {pinned} memory",
            "hpcckpt_sync": "hpcckpt engine sync", "hpcckpt_concurrent": "hpcckpt engine concurrent"}
    return {n: text[n] for n in names}


# -- exactness -----------------------------------------------------------------------

def _feed(h: Any, name: str, t: torch.Tensor) -> None:
    h.update(f"{name}|{t.dtype}|{tuple(t.shape)}|".encode())
    h.update(t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy())


def state_digest(rig: PeerRig) -> str:
    """sha256 of every model tensor and every optimizer state value, by parameter name."""
    h = hashlib.sha256()
    for name, t in sorted(rig.model.state_dict().items()):
        _feed(h, f"model/{name}", t)
    names = {id(p): n for n, p in rig.model.named_parameters()}
    for group in rig.opt.param_groups:
        for p in group["params"]:
            for key, v in sorted(rig.opt.state.get(p, {}).items()):
                if isinstance(v, torch.Tensor):
                    _feed(h, f"optim/{names[id(p)]}/{key}", v)
                else:
                    h.update(f"optim/{names[id(p)]}/{key}={v!r}".encode())
    return h.hexdigest()


# -- saving --------------------------------------------------------------------------

class _Pending:
    """One save in progress: when it started, and when it became durable (once known)."""

    def __init__(self, t0: float, path: Path, done_at: float | None = None, waiter: Any = None) -> None:
        self.t0, self.path, self.done_at, self.waiter = t0, path, done_at, waiter
        self.staging: Any = None


class Method:
    name = "method"

    def __init__(self, root: Path, rig: PeerRig) -> None:
        self.root, self.rig = root, rig
        root.mkdir(parents=True, exist_ok=True)
        self.newest: Path | None = None

    def start(self, step: int) -> _Pending:
        raise NotImplementedError

    def before_step(self, pending: _Pending) -> None:
        """Whatever the next optimizer.step() must wait for (nothing by default)."""

    def persist_s(self, pending: _Pending) -> float:
        """Wait until ``pending`` is durable; seconds from start() to durable. Older checkpoints go."""
        if pending.waiter is not None:
            pending.waiter()
            pending.waiter = None
        done = pending.done_at if pending.done_at is not None else time.perf_counter()
        pending.done_at = done
        self._keep_only(pending.path)
        return done - pending.t0

    def hook_wait_s(self) -> float:
        return 0.0

    def close(self) -> None:
        pass

    def _keep_only(self, path: Path) -> None:
        self.newest = path
        for old in self.root.iterdir():
            if old != path and old.name.startswith("step-"):
                shutil.rmtree(old) if old.is_dir() else old.unlink()


class TorchSave(Method):
    name = "torch_save"

    def start(self, step: int) -> _Pending:
        t0 = time.perf_counter()
        path = self.root / f"step-{step}.pt"
        with open(path, "wb") as f:
            torch.save({"model": self.rig.model.state_dict(), "optim": self.rig.opt.state_dict()}, f)
            f.flush()
            os.fsync(f.fileno())
        fsync_path(self.root)
        return _Pending(t0, path, done_at=time.perf_counter())


def _no_dist() -> dict[str, bool]:
    """One process and no process group: say so. DCP still warns that it assumes so, also from
    async_save's writer thread (outside any ``catch_warnings`` here): that one warning is
    filtered for the process."""
    import torch.distributed as dist
    warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized",
                            category=UserWarning)
    return {} if dist.is_available() and dist.is_initialized() else {"no_dist": True}


def _dcp_state(rig: PeerRig) -> dict[str, Any]:
    from torch.distributed.checkpoint.state_dict import get_state_dict
    model_sd, optim_sd = get_state_dict(rig.model, rig.opt)
    return {"model": model_sd, "optim": optim_sd}


class DcpSave(Method):
    name = "dcp_save"

    def start(self, step: int) -> _Pending:
        import torch.distributed.checkpoint as dcp
        t0 = time.perf_counter()
        path = self.root / f"step-{step}"
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            dcp.save(_dcp_state(self.rig), checkpoint_id=str(path), **_no_dist())
        return _Pending(t0, path, done_at=time.perf_counter())


def _done_at(pending: _Pending, future: Any) -> None:
    future.add_done_callback(lambda _f: setattr(pending, "done_at", time.perf_counter()))
    pending.waiter = future.result


class DcpAsync(Method):
    """``dcp.async_save``: thread (staging in the call), process, or thread with async staging."""

    def __init__(self, root: Path, rig: PeerRig, kind: str) -> None:
        super().__init__(root, rig)
        self.name, self.kind = {"thread": "dcp_async", "process": "dcp_async_process",
                                "staged": "dcp_async_staged"}[kind], kind
        self.stager: Any = None
        if kind == "process":
            _one_rank_group()
            _quiet_stderr()
        if kind == "staged":
            from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
            cuda = rig.device == "cuda"
            self.stager = DefaultStager(StagingOptions(use_pinned_memory=cuda, use_shared_memory=False,
                                                       use_async_staging=True, use_non_blocking_copy=cuda))

    def start(self, step: int) -> _Pending:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType
        t0 = time.perf_counter()
        path = self.root / f"step-{step}"
        kwargs: dict[str, Any] = {"checkpoint_id": str(path), **_no_dist()}
        if self.kind == "process":
            kwargs["async_checkpointer_type"] = AsyncCheckpointerType.PROCESS
        if self.stager is not None:
            kwargs["async_stager"] = self.stager
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            got: Any = dcp.async_save(_dcp_state(self.rig), **kwargs)
        pending = _Pending(t0, path)
        if hasattr(got, "upload_completion"):  # AsyncSaveResponse: staging and upload futures
            pending.staging = got.staging_completion
            _done_at(pending, got.upload_completion)
        else:
            _done_at(pending, got)
        return pending

    def before_step(self, pending: _Pending) -> None:
        if pending.staging is not None:
            pending.staging.result()
            pending.staging = None

    def close(self) -> None:
        if self.stager is not None:
            self.stager.close()


def _quiet_stderr() -> None:
    """DCP's checkpoint daemon adds its own INFO handler to the root logger and logs every
    request on the stderr it inherits; this (measurement) process's stderr goes to
    /dev/null so that bench's own progress stays readable. Its errors still come back
    through the save's future."""
    fd = os.open(os.devnull, os.O_WRONLY)
    os.dup2(fd, 2)
    os.close(fd)


def _one_rank_group() -> None:
    """DCP's process-based async save needs a process group: a 1-rank gloo group on loopback."""
    import socket

    import torch.distributed as dist
    if dist.is_initialized():
        return
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)


class Hpcckpt(Method):
    def __init__(self, root: Path, rig: PeerRig, engine: str, options: dict[str, Any]) -> None:
        super().__init__(root, rig)
        from ..config import engine_options
        from ..engines import SaveContext, make_engine
        from ..ranks import Ranks
        self.name = f"hpcckpt_{engine}"
        ctx = SaveContext(root=root, keep=1, job={}, user={})
        self.engine = make_engine(engine, ctx, Ranks(), engine_options(**options) if engine == "concurrent" else None)
        self.engine.bind(rig.state)
        if hasattr(self.engine, "wait_prepared"):
            self.engine.wait_prepared()  # a real loop keeps training while staging is laid out

    def start(self, step: int) -> _Pending:
        from ..store import catalog
        t0 = time.perf_counter()
        handle = self.engine.save(self.rig.state.capture(step=step), step)
        pending = _Pending(t0, self.root / catalog.step_name(step))

        def wait() -> None:
            handle.wait()
            # the engine's own clock, from save() to the durable commit; else when we saw it
            pending.done_at = t0 + handle.save_s if handle.save_s else time.perf_counter()
        pending.waiter = wait
        return pending

    def _keep_only(self, path: Path) -> None:
        self.newest = path  # the engine's retention (keep=1) owns its directory

    def hook_wait_s(self) -> float:
        return float(getattr(getattr(self.engine, "stats", None), "hook_wait_s", 0.0))

    def close(self) -> None:
        self.engine.close()


def make_method(name: str, root: Path, rig: PeerRig, options: dict[str, Any]) -> Method:
    if name == "torch_save":
        return TorchSave(root, rig)
    if name == "dcp_save":
        return DcpSave(root, rig)
    if name in DCP_ASYNC:
        return DcpAsync(root, rig, {"dcp_async": "thread", "dcp_async_process": "process",
                                    "dcp_async_staged": "staged"}[name])
    if name in HPCCKPT:
        return Hpcckpt(root, rig, HPCCKPT[name], options)
    raise ValueError(f"unknown method {name!r}; valid: {', '.join(ALL)}")


# -- restoring -----------------------------------------------------------------------

def import_for(name: str) -> None:
    """Import what ``restore(name, ...)`` uses, so that no import lands inside a timed restore
    (the forkserver preloads most of it; this makes sure)."""
    if name.startswith("dcp"):
        import torch.distributed.checkpoint  # noqa: F401
        import torch.distributed.checkpoint.state_dict  # noqa: F401
    elif name in HPCCKPT:
        from ..engines import load_rank  # noqa: F401
        from ..engines.base import live_tensors  # noqa: F401
        from ..store import catalog  # noqa: F401


def restore(name: str, path: Path, rig: PeerRig) -> None:
    """Read the checkpoint at ``path`` (written by ``name``) into ``rig``, built fresh (warm=False)."""
    if name == "torch_save":
        saved = torch.load(path, map_location=rig.device, weights_only=True)
        rig.model.load_state_dict(saved["model"])
        rig.opt.load_state_dict(saved["optim"])
    elif name.startswith("dcp"):
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import set_state_dict
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            sd = _dcp_state(rig)  # a fresh AdamW's state is laid out first (lr 0), as DCP documents
            dcp.load(sd, checkpoint_id=str(path), **_no_dist())
            set_state_dict(rig.model, rig.opt, model_state_dict=sd["model"], optim_state_dict=sd["optim"])
    else:
        from ..engines import load_rank
        from ..engines.base import live_tensors
        from ..store import catalog
        info = catalog.find(path.parent, int(path.name.split("-")[1]))
        live = live_tensors(rig.state.capture(step=0, plan=False).tensors, rig.state.objects)
        rig.state.restore(load_rank(info, 0, 1, into=live))
    rig.sync()
