"""The concurrent engine against real files, the real native core and real torch optimizers."""
from __future__ import annotations

import errno
import os
from collections.abc import Iterator
from pathlib import Path

import h5py
import numpy as np
import pytest
import torch

from hpcckpt import _native
from hpcckpt.engines import SaveContext, load_rank
from hpcckpt.engines.concurrent import ConcurrentEngine, Layout
from hpcckpt.errors import CheckpointFailed
from hpcckpt.ranks import Ranks
from hpcckpt.state import TrainState
from hpcckpt.store import catalog
from hpcckpt.store.lock import writer_lock

pytestmark = pytest.mark.native


class Net(torch.nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.a = torch.nn.Linear(width, width)
        self.bn = torch.nn.BatchNorm1d(width)
        self.b = torch.nn.Linear(width, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.relu(self.bn(self.a(x))))


class Rig:
    """A model, Adam, a registered TrainState and an engine on a fresh root."""

    def __init__(self, root: Path, width: int = 32, keep: int = 50, **options: object) -> None:
        torch.manual_seed(0)
        self.root = root
        self.model = Net(width)
        self.opt = torch.optim.Adam(self.model.parameters(), lr=1e-2)
        self.state = TrainState()
        self.state.register("model", self.model)
        self.state.register("optimizer", self.opt)
        self.engine = ConcurrentEngine(SaveContext(root=root, keep=keep, job={}, user={}), Ranks(), **options)
        self.engine.bind(self.state)
        self.width = width

    def train_step(self) -> None:
        x = torch.randn(8, self.width)
        loss = self.model(x).square().mean()
        self.opt.zero_grad()
        loss.backward()
        self.opt.step()

    def snapshot(self, step: int) -> dict[str, torch.Tensor]:
        flat = self.state.capture(step=step)
        return {n: t.clone() for n, t in flat.tensors.items()}

    def load(self, step: int) -> dict[str, torch.Tensor]:
        return load_rank(catalog.find(self.root, step), 0, 1).tensors


@pytest.fixture
def rig(tmp_path: Path) -> Iterator[Rig]:
    r = Rig(tmp_path / "ckpt")
    yield r
    r.engine.close()


def assert_same(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert got.keys() == want.keys()
    for name in want:
        assert got[name].dtype == want[name].dtype, name
        assert torch.equal(got[name], want[name]), name


def test_round_trip_is_exact_and_a_standard_hdf5_file(rig: Rig) -> None:
    for _ in range(3):
        rig.train_step()
    want = rig.snapshot(3)
    handle = rig.engine.save(rig.state.capture(step=3), 3)
    assert handle.wait(timeout=60)
    assert handle.path == rig.root / "step-3"
    assert_same(rig.load(3), want)
    manifest, problems = catalog.check(handle.path, full=True)
    assert problems == []
    assert manifest is not None and manifest["engine"] == "concurrent"
    with h5py.File(handle.path / "rank-0.h5", "r") as f:
        np.testing.assert_array_equal(f["objects/model/a.weight"][...], want["objects/model/a.weight"].numpy())


def test_each_tensor_carries_its_crc32c(rig: Rig) -> None:
    rig.train_step()
    want = rig.snapshot(1)
    handle = rig.engine.save(rig.state.capture(step=1), 1)
    handle.wait(timeout=60)
    _, entries = catalog.rank_entries(catalog.find(rig.root, 1).manifest or {}, 0)
    assert entries.keys() == want.keys()
    for name, entry in entries.items():
        t = want[name].contiguous()
        expected = _native.crc32c(t.reshape(-1).view(torch.uint8).numpy()) if t.numel() else 0
        assert entry.crc32c == expected, name
    # A flipped byte inside one tensor is caught and named.
    e = entries["objects/model/a.weight"]
    with open(handle.path / "rank-0.h5", "r+b") as f:
        f.seek(e.offset + 5)
        byte = f.read(1)
        f.seek(e.offset + 5)
        f.write(bytes([byte[0] ^ 0xFF]))
    _, problems = catalog.check(handle.path, full=True)
    assert any("a.weight" in p for p in problems)


def test_several_saves_in_flight_each_hold_their_own_step(tmp_path: Path) -> None:
    rig = Rig(tmp_path / "ckpt", width=256, max_async=3, writer_threads=2, chunk_bytes=64 << 10)
    try:
        rig.train_step()
        wants, handles = {}, []
        for step in range(1, 7):
            wants[step] = rig.snapshot(step)
            handles.append(rig.engine.save(rig.state.capture(step=step), step))
            rig.train_step()  # the pre-hook keeps this from overwriting un-staged state
        for h in handles:
            assert h.wait(timeout=120)
        for step, want in wants.items():
            assert_same(rig.load(step), want)
        assert rig.engine.stats.saves == 6
        assert len(rig.engine._slots) == 3  # one per save in flight, allocated once
    finally:
        rig.engine.close()


def test_staging_is_reused_not_reallocated(rig: Rig) -> None:
    rig.train_step()
    rig.engine.save(rig.state.capture(step=1), 1).wait(timeout=60)
    addresses = [s.buffer.address for s in rig.engine._slots]
    for step in range(2, 6):
        rig.train_step()
        rig.engine.save(rig.state.capture(step=step), step).wait(timeout=60)
    assert [s.buffer.address for s in rig.engine._slots] == addresses
    assert all(a % 4096 == 0 for a in addresses)


def test_pre_hook_blocks_until_sources_are_staged(tmp_path: Path) -> None:
    # 50 MB of state, one writer thread and small chunks: the copy is still running
    # when optimizer.step() is called right after save() (the gradients are ready).
    rig = Rig(tmp_path / "ckpt", width=2048, writer_threads=1, chunk_bytes=64 << 10)
    try:
        rig.train_step()
        rig.model(torch.randn(8, rig.width)).square().mean().backward()
        want = rig.snapshot(1)
        seen: dict[str, object] = {}

        def after_engine_hook(opt: torch.optim.Optimizer, args: object, kwargs: object) -> None:
            # Runs after the engine's pre-hook (hooks run in registration order).
            job = rig.engine._inflight[0]
            staged = {}
            for name, off in job.layout.staging_offset.items():
                e = job.layout.entries[name]
                staged[name] = bytes(job.slot.bytes[off:off + e.nbytes])
            seen["staged"] = staged

        hook = rig.opt.register_step_pre_hook(after_engine_hook)
        rig.engine.save(rig.state.capture(step=1), 1)
        rig.opt.step()
        hook.remove()
        rig.engine.drain()
        staged = seen["staged"]
        assert isinstance(staged, dict)
        for name, t in want.items():
            assert staged[name] == t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes(), name
        # ...and the step really changed the live parameters afterwards.
        assert not torch.equal(rig.model.a.weight, want["objects/model/a.weight"])
        assert_same(rig.load(1), want)
        assert rig.engine.stats.hook_wait_s >= 0.0 and rig.engine.stats.saves == 1
    finally:
        rig.engine.close()


def _fifo_instead_of_rank_file(path: Path) -> None:
    # pwrite on a FIFO fails with ESPIPE in the native writers: a real I/O error.
    os.mkfifo(path)


def test_write_error_is_raised_once_and_previous_checkpoint_survives(rig: Rig, monkeypatch: pytest.MonkeyPatch) -> None:
    rig.train_step()
    want = rig.snapshot(1)
    rig.engine.save(rig.state.capture(step=1), 1).wait(timeout=60)
    rig.train_step()
    # the rank file is made by create (host state, metadata written by the writers) or materialise
    monkeypatch.setattr(Layout, "materialise", lambda self, path: _fifo_instead_of_rank_file(path))
    monkeypatch.setattr(Layout, "create", lambda self, path: _fifo_instead_of_rank_file(path))
    handle = rig.engine.save(rig.state.capture(step=2), 2)
    with pytest.raises(CheckpointFailed) as info:
        handle.wait(timeout=60)
    assert "step 2" in str(info.value) and "rank 0" in str(info.value)
    assert handle.wait(timeout=1) is True  # raised exactly once
    assert [p.name for p in rig.root.iterdir() if p.name.startswith("step-")] == ["step-1"]
    assert_same(rig.load(1), want)
    monkeypatch.undo()
    rig.train_step()
    rig.engine.save(rig.state.capture(step=3), 3).wait(timeout=60)
    assert catalog.find(rig.root, None).step == 3


def wait_persisted(engine: ConcurrentEngine, n: int) -> None:
    """Until ``n`` saves in flight have their bytes durable (only their commits left)."""
    with engine._cond:
        assert engine._cond.wait_for(lambda: sum(j.persisted for j in engine._inflight) >= n, timeout=60)


def test_busy_engine_skips_when_asked_and_says_so(tmp_path: Path) -> None:
    rig = Rig(tmp_path / "ckpt", max_async=1, on_busy="skip")
    try:
        rig.train_step()
        with writer_lock(rig.root):  # no save can commit: they stay in flight
            first = rig.engine.save(rig.state.capture(step=1), 1)
            wait_persisted(rig.engine, 1)
            second = rig.engine.save(rig.state.capture(step=2), 2)  # the pipeline: first only commits
            assert not second.done()
            third = rig.engine.save(rig.state.capture(step=3), 3)  # one writing or durable, one committing
            assert third.done()
            with pytest.raises(CheckpointFailed, match="skipped"):
                third.wait()
            assert not first.done()
        assert first.wait(timeout=60) and second.wait(timeout=60)
        assert rig.engine.stats.skipped == 1
        assert catalog.find(rig.root, None).step == 2
    finally:
        rig.engine.close()


def test_a_save_waits_for_the_previous_bytes_not_its_commit(tmp_path: Path) -> None:
    """max_async=1: the commit pipeline admits the next save once the previous one's bytes are
    durable (its commit still held here by the writer lock), never more than one beyond."""
    import threading
    rig = Rig(tmp_path / "ckpt", max_async=1)
    try:
        want = {}
        with writer_lock(rig.root):
            rig.train_step()
            want[1] = rig.snapshot(1)
            first = rig.engine.save(rig.state.capture(step=1), 1)
            wait_persisted(rig.engine, 1)
            rig.train_step()  # the pre-hook: the first save's sources were copied
            want[2] = rig.snapshot(2)
            with rig.engine._cond:
                assert not rig.engine._busy()  # the first save only commits
            second = rig.engine.save(rig.state.capture(step=2), 2)  # admitted at once
            assert not first.done() and not second.done()
            rig.train_step()
            want[3] = rig.snapshot(3)
            flat3 = rig.state.capture(step=3)
            with rig.engine._cond:
                assert rig.engine._busy()  # a third would wait: two in flight, one committing
            third: list = []
            t = threading.Thread(target=lambda: third.append(rig.engine.save(flat3, 3)))
            t.start()
        t.join(60)
        assert third and third[0].wait(timeout=60) and first.wait(timeout=60) and second.wait(timeout=60)
        assert [i.step for i in catalog.scan(rig.root)] == [1, 2, 3]
        for step in (1, 2, 3):
            assert_same(rig.load(step), want[step])
    finally:
        rig.engine.close()


def test_a_slot_packs_small_tensors_and_aligns_large_ones_for_o_direct(tmp_path: Path) -> None:
    """Staging grows with the bytes, not the tensor count: small tensors are packed (they are
    written through the page cache), large ones sit congruent to their file offset modulo
    4 KiB (O_DIRECT needs both sides aligned). Many small tensors then round-trip exactly."""
    from hpcckpt.store.entry import ALIGN
    from hpcckpt.store.hdf5 import ALIGN_THRESHOLD

    torch.manual_seed(0)
    model = torch.nn.Module()
    model.small = torch.nn.ParameterList([torch.nn.Parameter(torch.randn(3 + i % 50)) for i in range(600)])
    model.big = torch.nn.ParameterList([torch.nn.Parameter(torch.randn(40_000 + 7 * i)) for i in range(3)])
    state = TrainState()
    state.register("model", model)
    tensors = state.capture(step=1).tensors
    specs = tuple((n, t.dtype, tuple(t.shape)) for n, t in tensors.items())
    layout = Layout.plan(tmp_path / "plan.h5", specs)
    big = [n for n in layout.names if layout.entries[n].nbytes >= ALIGN_THRESHOLD]
    assert len(big) == 3
    for n in big:
        assert layout.staging_offset[n] % ALIGN == layout.entries[n].offset % ALIGN, n
    spans = sorted((layout.staging_offset[n], layout.staging_offset[n] + layout.entries[n].nbytes)
                   for n in layout.names)
    assert all(a[1] <= b[0] for a, b in zip(spans, spans[1:]))  # no two tensors share a byte
    state_bytes = sum(layout.entries[n].nbytes for n in layout.names)
    assert layout.slot_bytes <= state_bytes + len(big) * ALIGN + len(layout.names) * 64 + ALIGN
    assert layout.slot_bytes < state_bytes + len(layout.names) * ALIGN // 4  # a page each was 2x here

    engine = ConcurrentEngine(SaveContext(root=tmp_path / "ckpt", keep=2, job={}, user={}), Ranks(), direct=True)
    try:
        engine.bind(state)
        want = {n: t.clone() for n, t in state.capture(step=1).tensors.items()}
        assert engine.save(state.capture(step=1), 1).wait(timeout=60)
    finally:
        engine.close()
    assert_same(load_rank(catalog.find(tmp_path / "ckpt", 1), 0, 1).tensors, want)


class _HostCopy:
    """The D2H seam for CPU tests: every tensor takes the GPU route, and the "device-to-host"
    copy is a host copy whose done event the test releases (``_D2H``)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        from hpcckpt.engines import stage
        self.copies: list[_D2H] = []

        def copy_to_host(engine: ConcurrentEngine, pairs: list) -> tuple[_D2H, None]:
            for dst, src in pairs:
                dst.copy_(src.detach().reshape(-1).view(torch.uint8))
            self.copies.append(_D2H())
            return self.copies[-1], None

        monkeypatch.setattr(stage, "routes",
                            lambda tensors, is_safe, **_: dict.fromkeys(tensors, stage.DEVICE))
        monkeypatch.setattr(ConcurrentEngine, "_copy_to_host", copy_to_host)
        monkeypatch.setattr(ConcurrentEngine, "_all_at_once", lambda self, layout: False)


def test_a_device_save_over_a_pruned_rank_file_rewrites_its_metadata(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The GPU route (at the D2H seam) reuses a pruned step's rank file like the host route:
    its HDF5 metadata is written again by the save's writers, so a spare whose metadata was
    damaged meanwhile still gives an exact, readable checkpoint."""
    from hpcckpt.engines.recycle import Recycler

    seam = _HostCopy(monkeypatch)
    real_take = Recycler.take
    damaged: list[Path] = []

    def take(self: Recycler, tmp: Path, layout: Layout) -> bool:
        if not real_take(self, tmp, layout):
            return False
        with open(tmp / self.fname, "r+b") as fh:  # garbage over every byte the template writes
            for offset, data in layout.template[0]:  # type: ignore[index]
                fh.seek(offset)
                fh.write(b"\xa5" * len(data))
        damaged.append(tmp)
        return True

    monkeypatch.setattr(Recycler, "take", take)
    rig = Rig(tmp_path / "ckpt", keep=2)
    try:
        rig.train_step()
        rig.engine.wait_prepared(timeout=60)
        want = {}
        for step in range(1, 7):
            with torch.no_grad():
                for p in rig.model.parameters():
                    p.add_(0.5)
            want[step] = rig.snapshot(step)
            handle = rig.engine.save(rig.state.capture(step=step), step)
            seam.copies[-1].done.set()
            assert handle.wait(60)
            rig.engine._queue.join()  # its pruned step kept as the spare: the next save finds it
        assert damaged and rig.engine._recycler is not None and rig.engine._recycler.reused == len(damaged)
        assert [i.step for i in catalog.scan(rig.root)] == [5, 6]
        for step in (5, 6):
            assert_same(rig.load(step), want[step])
            with h5py.File(catalog.find(rig.root, step).path / "rank-0.h5", "r") as f:
                assert len(f.keys()) > 0
    finally:
        rig.engine.close()


class _D2H:
    """A save's device-to-host copy at the launcher seam: ``synchronize`` returns when the
    test says the copy is done, raising ``fail`` if set (a CUDA error)."""

    def __init__(self) -> None:
        import threading
        self.done = threading.Event()
        self.fail: BaseException | None = None

    def synchronize(self) -> None:
        assert self.done.wait(60)
        if self.fail is not None:
            raise self.fail


def test_a_device_copy_starts_its_writes_while_the_previous_save_commits(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A state on a GPU: each save's writes start once its D2H copy is done (the launcher
    thread), not after the previous save's commit on the finisher; a failed copy is that
    save's error and the checkpoints around it are intact. The GPU is replaced at one seam:
    the copy is a host copy whose done event the test releases (tests/gpu runs the real one)."""
    copies = _HostCopy(monkeypatch).copies
    rig = Rig(tmp_path / "ckpt", max_async=1)

    def save(step: int) -> tuple[object, dict[str, torch.Tensor]]:
        with torch.no_grad():  # a new state by hand: optimizer.step() would order a CUDA stream
            for p in rig.model.parameters():
                p.add_(1.0)
        want = rig.snapshot(step)
        return rig.engine.save(rig.state.capture(step=step), step), want

    try:
        rig.train_step()
        rig.engine.wait_prepared(timeout=60)
        want = {}
        with writer_lock(rig.root):  # no commit can finish
            first, want[1] = save(1)
            copies[0].done.set()
            wait_persisted(rig.engine, 1)
            second, want[2] = save(2)  # admitted: the first only commits
            job = rig.engine._inflight[1]
            assert not job.launched.is_set()  # its copy is not done yet
            copies[1].done.set()
            assert job.launched.wait(60) and job.launch_error is None  # writing, the first commit still held
            assert job.batch.wait(60)  # its bytes are durable before the first save has committed
            assert not first.done()
        assert first.wait(60) and second.wait(60) and first.error is None and second.error is None
        third, _ = save(3)
        copies[2].fail = RuntimeError("CUDA error: an illegal memory access was encountered")
        copies[2].done.set()
        with pytest.raises(CheckpointFailed, match="step 3 .* illegal memory access"):
            third.wait(60)
        fourth, want[4] = save(4)
        copies[3].done.set()
        assert fourth.wait(60) and fourth.error is None
        assert [i.step for i in catalog.scan(rig.root)] == [1, 2, 4]
        for step in (1, 2, 4):
            assert_same(rig.load(step), want[step])
    finally:
        rig.engine.close()
    assert rig.engine._launcher is not None and not rig.engine._launcher.is_alive()


def test_final_save_never_skips(tmp_path: Path) -> None:
    rig = Rig(tmp_path / "ckpt", max_async=1, on_busy="skip")
    try:
        rig.train_step()
        first = rig.engine.save(rig.state.capture(step=1), 1)
        final = rig.engine.save(rig.state.capture(step=2), 2, final=True)
        assert first.wait(timeout=60) and final.wait(timeout=60)
        assert catalog.find(rig.root, None).step == 2
    finally:
        rig.engine.close()


def test_memory_budget_smaller_than_one_copy_is_refused(tmp_path: Path) -> None:
    rig = Rig(tmp_path / "ckpt", memory_budget_bytes=1024, staging_bytes="full")
    try:
        rig.train_step()
        with pytest.raises(Exception, match="memory_budget_bytes"):
            rig.engine.save(rig.state.capture(step=1), 1)
        rig.engine.drain()  # the failed save still went through the (one-rank) commit exchange
        assert not any(p.name.startswith("step-1") for p in rig.root.iterdir())
    finally:
        rig.engine.close()


def test_fifo_error_really_is_espipe(tmp_path: Path) -> None:
    # Guards the fault injection above: the native core reports the FIFO write error.
    fifo = tmp_path / "f"
    os.mkfifo(fifo)
    with _native.WriterPool(threads=1) as pool:
        b = _native.Batch(pool)
        b.add(str(fifo), 0, np.ones(16, dtype=np.uint8))
        b.start()
        with pytest.raises(OSError) as info:
            b.wait()
    assert info.value.errno in (errno.ESPIPE, errno.EINVAL)


def test_memory_budget_bounds_the_saves_in_flight(tmp_path: Path) -> None:
    probe = Rig(tmp_path / "probe")
    probe.train_step()
    probe.engine.save(probe.state.capture(step=1), 1).wait(timeout=60)
    slot_bytes = probe.engine._slots[0].bytes.nbytes
    probe.engine.close()
    rig = Rig(tmp_path / "ckpt", max_async=3, memory_budget_bytes=2 * slot_bytes + slot_bytes // 2,
              staging_bytes="full")
    try:
        rig.train_step()
        rig.engine.save(rig.state.capture(step=1), 1).wait(timeout=60)
        assert len(rig.engine._slots) == 2 and rig.engine.max_async == 2
    finally:
        rig.engine.close()


def test_memory_budget_lowers_max_async_only_when_the_staging_is_installed(tmp_path: Path) -> None:
    probe = Rig(tmp_path / "probe")
    probe.train_step()
    probe.engine.save(probe.state.capture(step=1), 1).wait(timeout=60)
    slot_bytes = probe.engine._slots[0].bytes.nbytes
    probe.engine.close()
    rig = Rig(tmp_path / "ckpt", max_async=3, memory_budget_bytes=slot_bytes + slot_bytes // 2,
              staging_bytes="full")
    try:
        rig.train_step()  # the post-hook prepares staging on a background thread
        assert rig.engine._prep is not None and rig.engine.wait_prepared(timeout=60)
        prepared = rig.engine._prep.staging
        assert prepared is not None and len(prepared.slots) == 1
        # Prepared but not installed (it might still be dropped for new shapes): untouched.
        assert rig.engine.max_async == 3
        rig.engine.save(rig.state.capture(step=1), 1).wait(timeout=60)
        assert rig.engine._staging is prepared and rig.engine.max_async == 1
    finally:
        rig.engine.close()


def test_cpu_sources_are_staged_by_save_when_a_device_copy_is_pending(
        rig: Rig, monkeypatch: pytest.MonkeyPatch) -> None:
    """With a D2H pending the pre-hook does not wait on the host, so optimizer.step() may run
    while the writers would still copy CPU sources (Adam's step counters of CUDA parameters).
    Routed as if a D2H were pending, every CPU source is in the slot when save() returns."""
    import functools

    from hpcckpt.engines import concurrent, stage

    rig.train_step()
    rig.engine.wait_prepared(timeout=60)
    want = rig.snapshot(1)
    monkeypatch.setattr(stage, "routes", functools.partial(stage.routes, gpu_pending=True))
    # staged tensor by tensor, by those routes (a host state is otherwise staged all at once)
    monkeypatch.setattr(concurrent.ConcurrentEngine, "_all_at_once", lambda self, layout: False)
    handle = rig.engine.save(rig.state.capture(step=1), 1)
    # What optimizer.step() does on the host while a GPU job's pre-hook returns at once.
    with torch.no_grad():
        for p in rig.model.parameters():
            p.add_(1.0)
        for s in rig.opt.state.values():
            s["step"].add_(1)
            s["exp_avg"].add_(1.0)
    assert handle.wait(timeout=60)
    assert_same(rig.load(1), want)


def test_routes_copy_cpu_sources_at_save_time_whenever_a_tensor_is_on_a_gpu() -> None:
    from hpcckpt.engines.stage import DEVICE, HOST_BATCH, HOST_NOW, routes

    tensors = {"objects/opt/state/0/step": torch.tensor(3.0), "objects/model/w": torch.ones(4),
               "objects/model/bn.running_mean": torch.zeros(4), "objects/model/t": torch.ones(4, 4).t()}
    safe = {"objects/opt/state/0/step", "objects/model/w", "objects/model/t"}.__contains__
    assert routes(tensors, safe) == {"objects/opt/state/0/step": HOST_BATCH, "objects/model/w": HOST_BATCH,
                                      "objects/model/bn.running_mean": HOST_NOW, "objects/model/t": HOST_NOW}
    assert set(routes(tensors, safe, gpu_pending=True).values()) == {HOST_NOW}
    assert DEVICE not in routes(tensors, safe).values()


def test_tensors_on_two_cuda_devices_are_refused_with_a_fix() -> None:
    from hpcckpt.errors import ConfigError
    from hpcckpt.store.hostmem import one_cuda_device

    cpu, d0, d1 = torch.device("cpu"), torch.device("cuda", 0), torch.device("cuda", 1)
    assert one_cuda_device([cpu, cpu], "checkpoint") is None
    assert one_cuda_device([cpu, d0, d0], "checkpoint") == d0
    with pytest.raises(ConfigError, match=r"checkpoint: .*cuda:0, cuda:1.*one rank per GPU"):
        one_cuda_device([d0, cpu, d1], "checkpoint")


def test_a_state_without_data_bytes_is_fsynced_before_its_commit(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    engine = ConcurrentEngine(SaveContext(root=tmp_path / "ckpt", keep=2, job={}, user={}), Ranks())
    synced: list[str] = []
    real_fsync = os.fsync

    def fsync(fd: int) -> None:  # a real fsync, recorded by path
        synced.append(os.readlink(f"/proc/self/fd/{fd}"))
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    try:
        from hpcckpt.state import Flat
        flat = Flat(tensors={"objects/empty/x": torch.zeros(0), "objects/empty/y": torch.zeros(0, 3)},
                    meta={"step": 1})
        handle = engine.save(flat, 1)
        assert handle.wait(timeout=60) and handle.path is not None
    finally:
        engine.close()
    assert any(p.endswith("/rank-0.h5") and ".tmp-" in p for p in synced), synced
