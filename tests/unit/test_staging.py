"""The concurrent engine's staging: background preparation and the ring under a budget (CPU tensors).

The ring streams the state through chunks smaller than it; the CUDA path of the
same ring (D2H on a side stream) is covered by tests/gpu/test_engine_gpu.py.
"""
from __future__ import annotations

import gc
import os
import signal
import threading
import time
import weakref
from pathlib import Path

import pytest
import torch

from hpcckpt.api import Checkpointer, RequeueExit
from hpcckpt.config import concurrent_options
from hpcckpt.engines import SaveContext
from hpcckpt.engines.concurrent import ConcurrentEngine, Layout
from hpcckpt.engines.staging import ALIGN, plan_rounds, ring_shape
from hpcckpt.errors import CheckpointCorrupt, CheckpointFailed, ConfigError
from hpcckpt.ranks import Ranks
from hpcckpt.store import catalog
from hpcckpt.store.hdf5 import TensorEntry, read_tensors, write_tensors
from hpcckpt.store.staged_read import read_staged
from tests.helpers import tiny_state, train_step

from .test_concurrent_engine import Rig, _fifo_instead_of_rank_file, assert_same

pytestmark = pytest.mark.native


def _state_bytes(tmp_path: Path, **options: object) -> int:
    probe = Rig(tmp_path / "probe", width=256, **options)
    try:
        probe.train_step()
        probe.engine.save(probe.state.capture(step=1), 1).wait(timeout=60)
        assert probe.engine._staging is not None
        return probe.engine._staging.layout.state_bytes
    finally:
        probe.engine.close()


# -- the plan ------------------------------------------------------------------

@pytest.mark.parametrize("chunk", [2 * ALIGN, 3 * ALIGN, 64 << 10])
def test_rounds_cover_every_byte_once_aligned_as_in_the_file(chunk: int) -> None:
    sizes = [1, 3, 4095, 4096, 4097, 0, 70_001, 2 * ALIGN, 123_457, 7]
    entries, offset = [], 2048 + 5  # odd start: heads and tails are unaligned
    for i, n in enumerate(sizes):
        entries.append(TensorEntry(f"t{i}", "uint8", (n,), offset, n))
        offset += n + (ALIGN if n > 60_000 else 3)
    rounds = plan_rounds(entries, chunk)
    covered: dict[str, list[tuple[int, int]]] = {}
    for pieces in rounds:
        spans = sorted((p.chunk_off, p.chunk_off + p.nbytes) for p in pieces)
        assert all(hi <= chunk for _, hi in spans)
        assert all(a[1] <= b[0] for a, b in zip(spans, spans[1:]))  # no overlap inside a chunk
        for p in pieces:
            assert p.nbytes > 0
            assert p.chunk_off % ALIGN == p.file_off % ALIGN  # O_DIRECT needs both aligned alike
            covered.setdefault(p.name, []).append((p.src_off, p.nbytes))
    for e in entries:
        parts = sorted(covered.get(e.name, []))
        assert sum(n for _, n in parts) == e.nbytes
        assert all(a[0] + a[1] == b[0] for a, b in zip(parts, parts[1:]))
        pieces = [p for r in rounds for p in r if p.name == e.name]
        for p in pieces[1:]:
            assert p.file_off % ALIGN == 0  # a tensor is only cut at a 4 KiB boundary of the file
            assert p.file_off == e.offset + p.src_off


def test_ring_shape_stays_within_the_budget_and_is_refused_when_tiny() -> None:
    for budget in (16 << 10, 100_003, 1 << 20, 300 << 20):
        chunks, size = ring_shape(budget, 10 << 30)
        assert chunks >= 2 and size % ALIGN == 0 and chunks * size <= budget
    chunks, size = ring_shape(1 << 30, 1 << 20)  # a budget beyond the state is not all allocated
    assert chunks * size <= (1 << 20) + 4 * 2 * ALIGN + size
    with pytest.raises(ConfigError, match="staging_bytes"):
        ring_shape(4096, 1 << 20)
    with pytest.raises(ConfigError, match="multiple"):
        plan_rounds([], 5000)


# -- the ring in the engine, bit for bit ------------------------------------------

@pytest.mark.parametrize("share", [1.0, 0.5, 0.25, "odd"])
def test_ring_round_trip_is_exact_at_every_budget(tmp_path: Path, share: float | str) -> None:
    state = _state_bytes(tmp_path)
    budget = state // 4 + 3 * 4097 if share == "odd" else int(state * float(share))
    rig = Rig(tmp_path / "ckpt", width=256, staging_bytes=budget, writer_threads=2, chunk_bytes=16 << 10)
    try:
        rig.train_step()
        wants, handles = {}, []
        for step in range(1, 5):
            wants[step] = rig.snapshot(step)
            handles.append(rig.engine.save(rig.state.capture(step=step), step))
            rig.train_step()  # the pre-hook keeps this from overwriting un-copied sources
        for h in handles:
            assert h.wait(timeout=120)
        for step, want in wants.items():
            assert_same(rig.load(step), want)
            _, problems = catalog.check(catalog.find(rig.root, step).path, full=True)
            assert problems == []
        st = rig.engine.stats
        assert st.ring_chunks >= 1 and st.ring_chunks * st.ring_chunk_bytes == st.staging_bytes
        assert st.staging_bytes <= max(budget, 0)
        assert rig.engine._slots == []  # no full copy anywhere
        assert len(st.save_calls_s) == 4 and st.first_save_call_s == st.save_calls_s[0]
        assert len(st.persist_s) == 4 and st.d2h_bytes == 0  # nothing on a GPU
    finally:
        rig.engine.close()


def test_ring_pre_hook_returns_only_once_every_source_byte_is_copied(tmp_path: Path) -> None:
    state = _state_bytes(tmp_path)
    rig = Rig(tmp_path / "ckpt", width=256, staging_bytes=state // 4, writer_threads=1, chunk_bytes=8 << 10)
    try:
        rig.train_step()
        rig.model(torch.randn(8, rig.width)).square().mean().backward()
        want = rig.snapshot(1)
        seen: dict[str, bool] = {}

        def after_engine_hook(opt: torch.optim.Optimizer, args: object, kwargs: object) -> None:
            # The save may already be finished (and gone from the in-flight list): copied too.
            jobs = [j for j in rig.engine._inflight if j.handle is handle]
            seen["copied"] = all(j.copied.is_set() and j.sources is None for j in jobs)

        hook = rig.opt.register_step_pre_hook(after_engine_hook)
        handle = rig.engine.save(rig.state.capture(step=1), 1)
        rig.opt.step()
        hook.remove()
        assert seen == {"copied": True}
        assert handle.wait(timeout=60)
        assert not torch.equal(rig.model.a.weight, want["objects/model/a.weight"])
        assert_same(rig.load(1), want)
        assert handle.stall_s is not None and handle.stall_s >= 0.0
    finally:
        rig.engine.close()


def test_ring_with_several_saves_in_flight(tmp_path: Path) -> None:
    state = _state_bytes(tmp_path)
    rig = Rig(tmp_path / "ckpt", width=256, staging_bytes=state // 3, max_async=3, chunk_bytes=16 << 10)
    try:
        rig.train_step()
        wants, handles = {}, []
        for step in range(1, 7):
            wants[step] = rig.snapshot(step)
            handles.append(rig.engine.save(rig.state.capture(step=step), step))
            rig.train_step()
        for h in handles:
            assert h.wait(timeout=120)
        for step, want in wants.items():
            assert_same(rig.load(step), want)
    finally:
        rig.engine.close()


def test_ring_write_error_is_raised_once_and_the_ring_keeps_working(tmp_path: Path,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    state = _state_bytes(tmp_path)
    rig = Rig(tmp_path / "ckpt", width=256, staging_bytes=state // 4)
    try:
        rig.train_step()
        want = rig.snapshot(1)
        rig.engine.save(rig.state.capture(step=1), 1).wait(timeout=60)
        rig.train_step()
        monkeypatch.setattr(Layout, "materialise", lambda self, path: _fifo_instead_of_rank_file(path))
        handle = rig.engine.save(rig.state.capture(step=2), 2)
        rig.train_step()  # the hook must not hang on a failed stream
        with pytest.raises(CheckpointFailed, match="step 2"):
            handle.wait(timeout=60)
        assert handle.wait(timeout=1) is True
        assert_same(rig.load(1), want)
        monkeypatch.undo()
        want3 = rig.snapshot(3)
        rig.engine.save(rig.state.capture(step=3), 3).wait(timeout=60)
        assert_same(rig.load(3), want3)
    finally:
        rig.engine.close()


def test_staging_budget_options_are_checked(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(ConfigError, match="staging_bytes"):
        Rig(tmp_path / "a", staging_bytes=0)
    with pytest.raises(ConfigError, match="memory_budget_bytes"):
        Rig(tmp_path / "b", staging_bytes=1 << 20, memory_budget_bytes=1 << 19)
    monkeypatch.setenv("HPCCKPT_STAGING_BYTES", "65536")
    monkeypatch.setenv("HPCCKPT_RING_CHUNK_BYTES", "16K")
    rig = Rig(tmp_path / "c", **concurrent_options())  # resolved outside the engine
    try:
        assert (rig.engine.staging_bytes, rig.engine.ring_chunk_bytes) == (65536, 16 << 10)
    finally:
        rig.engine.close()
    rig = Rig(tmp_path / "e")  # the engine itself reads no environment: the table's defaults
    try:
        assert (rig.engine.staging_bytes, rig.engine.ring_chunk_bytes) == ("auto", None)
    finally:
        rig.engine.close()
    rig = Rig(tmp_path / "d", staging_bytes=8192)  # too small for a ring: said at the first save
    try:
        rig.train_step()
        with pytest.raises(ConfigError, match="HPCCKPT_STAGING_BYTES"):
            rig.engine.save(rig.state.capture(step=1), 1)
        rig.engine.drain()
    finally:
        rig.engine.close()


# -- preparation off the step path, release on close --------------------------------

@pytest.mark.parametrize("budget", [None, "quarter"])
def test_staging_is_prepared_after_the_first_step_and_used_by_the_first_save(tmp_path: Path,
                                                                             budget: str | None) -> None:
    staging_bytes = _state_bytes(tmp_path) // 4 if budget else None
    rig = Rig(tmp_path / "ckpt", width=256, staging_bytes=staging_bytes)
    try:
        assert rig.engine._prep is None  # no optimizer state yet: nothing to lay out
        rig.train_step()  # the optimizer state appears; the post-hook starts the preparation
        prep = rig.engine._prep
        assert prep is not None and prep.thread is not None
        prep.thread.join(timeout=60)
        assert prep.error is None and prep.staging is not None
        assert rig.engine.stats.prepare_s > 0 and rig.engine.stats.saves == 0
        assert not [p for p in rig.root.iterdir() if p.name.startswith(".hpcckpt-layout-")]  # scratch removed
        want = rig.snapshot(1)
        rig.engine.save(rig.state.capture(step=1), 1).wait(timeout=60)
        assert rig.engine._staging is prep.staging  # the save allocated nothing itself
        assert_same(rig.load(1), want)
        rig.train_step()
        assert rig.engine._prep is None  # same shapes: nothing more to prepare
    finally:
        rig.engine.close()
    assert rig.engine._staging is None and rig.engine.stats.staging_bytes == 0


@pytest.mark.parametrize("budget", [None, 64 << 10])
def test_close_frees_the_staging_memory(tmp_path: Path, budget: int | None) -> None:
    rig = Rig(tmp_path / "ckpt", width=256, staging_bytes=budget)
    rig.train_step()
    rig.engine.save(rig.state.capture(step=1), 1).wait(timeout=60)
    staging = rig.engine._staging
    assert staging is not None
    buffers = [weakref.ref(b) for b in (staging.ring.chunks if staging.ring else staging.slots)]
    del staging
    rig.engine.close()
    gc.collect()
    assert buffers and all(ref() is None for ref in buffers)  # nothing keeps the memory alive


def test_close_releases_staging_and_a_preparation_in_progress(tmp_path: Path) -> None:
    rig = Rig(tmp_path / "ckpt", width=256)
    rig.train_step()
    prep = rig.engine._prep
    rig.engine.close()
    assert prep is not None and prep.thread is not None and not prep.thread.is_alive()
    assert rig.engine._staging is None and rig.engine._prep is None
    assert rig.engine.stats.staging_bytes == 0 and rig.engine.stats.staging_pinned is False
    assert not [p for p in os.listdir(rig.root) if p.startswith(".hpcckpt-layout-")]


# -- staged restore (the GPU restore pipeline, exercised with CPU targets) ----------

@pytest.mark.parametrize(("chunk", "chunks", "direct"), [(2 * ALIGN, 2, False), (3 * ALIGN, 3, True),
                                                         (1 << 20, 1, True)])
def test_staged_read_lands_every_tensor_and_its_crc(tmp_path: Path, chunk: int, chunks: int, direct: bool) -> None:
    torch.manual_seed(1)
    tensors = {"a": torch.randn(5000), "b": torch.randint(0, 255, (7, 333), dtype=torch.uint8),
               "c": torch.randn(3, dtype=torch.float64), "d": torch.randn(128, 129).to(torch.bfloat16),
               "e": torch.zeros(0)}
    path = tmp_path / "rank-0.h5"
    entries = write_tensors(path, tensors)
    targets = [(entries[n], torch.full_like(t, 7) if t.dtype != torch.uint8 else torch.zeros_like(t))
               for n, t in tensors.items()]
    info: dict[str, int] = {}
    crcs = read_staged(path, targets, direct=direct, threads=2, chunk_bytes=chunk, chunks=chunks, info=info)
    for e, live in targets:
        assert torch.equal(live, tensors[e.name]), e.name
        if e.nbytes:
            assert crcs[e.name] == e.crc32c, e.name
    assert info["staged_bytes"] == sum(e.nbytes for e in entries.values())
    assert info["rounds"] >= (2 if chunk < (1 << 20) else 1)


def test_staged_read_crc_shows_a_flipped_byte_in_a_later_round(tmp_path: Path) -> None:
    tensors = {"a": torch.arange(20_000, dtype=torch.float32), "b": torch.arange(9_000, dtype=torch.int64)}
    path = tmp_path / "rank-0.h5"
    entries = write_tensors(path, tensors)
    e = entries["b"]
    with open(path, "r+b") as f:
        f.seek(e.offset + e.nbytes - 3)
        byte = f.read(1)
        f.seek(e.offset + e.nbytes - 3)
        f.write(bytes([byte[0] ^ 0x01]))
    targets = [(entries[n], torch.empty_like(t)) for n, t in tensors.items()]
    crcs = read_staged(path, targets, direct=False, chunk_bytes=2 * ALIGN, chunks=2)
    assert crcs["a"] == entries["a"].crc32c and crcs["b"] != e.crc32c
    with pytest.raises(CheckpointCorrupt, match="'b'"):
        read_tensors(path, entries)


def test_staged_read_copies_a_round_only_from_a_pinned_chunk_and_unpins_every_chunk(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The CUDA path's pinning (a thread registering the chunks while the first rounds are
    read) with the driver calls replaced at one seam: ``Slot.pin`` / ``Slot.release``."""
    from hpcckpt.store import hostmem, staged_read
    log: list[tuple[str, int]] = []
    lock = threading.Lock()

    def pin(self: hostmem.Slot) -> bool:
        time.sleep(0.02)  # registering takes a while; what is asserted holds however long
        with lock:
            log.append(("pin", id(self)))
        self.pinned = True
        return True

    def release(self: hostmem.Slot) -> None:
        if self.pinned:
            with lock:
                log.append(("unpin", id(self)))
            self.pinned = False

    real_copy_up = staged_read.StagedReader._copy_up

    def copy_up(self: staged_read.StagedReader, chunk: hostmem.Slot, pieces: list, stream: object) -> object:
        with lock:
            log.append(("copy", id(chunk)))
        return real_copy_up(self, chunk, pieces, stream)

    monkeypatch.setattr(hostmem.Slot, "pin", pin)
    monkeypatch.setattr(hostmem.Slot, "release", release)
    monkeypatch.setattr(staged_read.StagedReader, "_copy_up", copy_up)
    tensors = {"a": torch.randn(9000), "b": torch.randn(4000).double()}
    path = tmp_path / "rank-0.h5"
    entries = write_tensors(path, tensors)
    targets = [(entries[n], torch.zeros_like(t)) for n, t in tensors.items()]
    reader = staged_read.StagedReader(path, targets, direct=True, chunk_bytes=2 * ALIGN, chunks=3, pin=True)
    chunks = list(reader.chunks)
    assert len(chunks) == 3 and len(reader.rounds) > 3
    try:
        crcs = reader.read()
    finally:
        reader.release()
    for t in threading.enumerate():
        if t.name in ("hpcckpt-unpin", "hpcckpt-pin"):
            t.join()
    for e, live in targets:
        assert torch.equal(live, tensors[e.name]) and crcs[e.name] == e.crc32c, e.name
    for c in chunks:
        first_copy = log.index(("copy", id(c)))
        assert log.index(("pin", id(c))) < first_copy, log
        assert ("unpin", id(c)) in log and not c.pinned
    assert len([x for x in log if x[0] == "copy"]) == len(reader.rounds)


# -- through the Checkpointer --------------------------------------------------------

def _run(root: Path, total: int, *, signal_at: int | None = None, **options: object) -> tuple[list[str], dict]:
    objs = tiny_state(0)
    losses: list[str] = []
    with Checkpointer(root, engine="concurrent", every_steps=2, keep=2, **options) as ck:
        ck.register(**objs)
        for step in ck.steps(total):
            losses.append(float.hex(train_step(objs)))
            if signal_at is not None and step + 1 == signal_at:
                os.kill(os.getpid(), signal.SIGUSR2)
    return losses, objs


def test_checkpointer_with_a_staging_ring_resumes_exactly(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    ref, ref_objs = _run(tmp_path / "ref", 10)
    # tiny_state holds ~2 KB of tensors: a 16 KiB ring is the smallest allowed and still cycles
    with pytest.raises(RequeueExit):
        _run(tmp_path / "ckpt", 10, signal_at=5, staging_bytes=16 << 10)
    monkeypatch.setenv("HPCCKPT_STAGING_BYTES", "16K")
    rest, objs = _run(tmp_path / "ckpt", 10)
    assert ref[:5] + rest == ref
    for p, q in zip(objs["model"].state_dict().values(), ref_objs["model"].state_dict().values()):
        assert torch.equal(p, q)


def test_checkpointer_passes_staging_bytes_to_the_engine(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    with Checkpointer(tmp_path / "a", engine="concurrent", staging_bytes=1 << 20) as ck:
        assert isinstance(ck.engine, ConcurrentEngine) and ck.engine.staging_bytes == 1 << 20
    monkeypatch.setenv("HPCCKPT_STAGING_BYTES", "2M")
    with Checkpointer(tmp_path / "b", engine="concurrent") as ck:
        assert isinstance(ck.engine, ConcurrentEngine) and ck.engine.staging_bytes == 2 << 20
    monkeypatch.setenv("HPCCKPT_STAGING_BYTES", "-1")
    with pytest.raises(ConfigError, match="HPCCKPT_STAGING_BYTES"):
        Checkpointer(tmp_path / "c", engine="concurrent")
    monkeypatch.delenv("HPCCKPT_STAGING_BYTES")
    monkeypatch.setenv("HPCCKPT_RING_CHUNK_BYTES", "32K")
    with Checkpointer(tmp_path / "d", engine="concurrent", chunk_bytes=1 << 20) as ck:
        assert isinstance(ck.engine, ConcurrentEngine) and ck.engine.ring_chunk_bytes == 32 << 10
        assert ck.options.chunk_bytes == 1 << 20
    monkeypatch.setenv("HPCCKPT_CHUNK_BYTES", "1")
    with pytest.raises(ConfigError, match="HPCCKPT_CHUNK_BYTES"):
        Checkpointer(tmp_path / "e", engine="concurrent")


def test_optimizer_state_names_come_from_the_saved_tree_without_step() -> None:
    from hpcckpt.state import TrainState
    from hpcckpt.store.read import _optimizer_homes, _optimizer_state_names
    model = torch.nn.Linear(3, 2)
    adam, sgd = torch.optim.Adam(model.parameters()), torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.randn(1, 3)).sum().backward()
    adam.step()
    sgd.step()
    state = TrainState()
    state.register("model", model)
    state.register("adam", adam)
    state.register("sgd", sgd)
    flat = state.capture(step=1)
    names = _optimizer_state_names(flat.meta)
    assert sorted(names) == sorted(n for n in flat.tensors if "/state/" in n and not n.endswith("/step"))
    assert any(n.startswith("objects/sgd/state/") for n in names) and len(names) == 6
    assert _optimizer_state_names({"objects": {"x": {"state": 3}}}) == [] and _optimizer_state_names(None) == []
    # Without a CUDA tensor among the live ones, nothing is placed anywhere new.
    assert _optimizer_homes(flat.meta, {}, flat.tensors) == {}


def test_staging_is_prepared_at_bind_when_the_shapes_are_already_known(tmp_path: Path) -> None:
    rig = Rig(tmp_path / "first", width=64)
    rig.train_step()  # the optimizer now holds state
    rig.engine.close()
    engine = ConcurrentEngine(SaveContext(root=tmp_path / "ckpt", keep=2, job={}, user={}), Ranks())
    try:
        engine.bind(rig.state)  # e.g. after a restore: nothing to wait for
        prep = engine._prep
        assert prep is not None and engine.wait_prepared(timeout=60)
        assert prep.staging is not None
        engine.save(rig.state.capture(step=1), 1).wait(timeout=60)
        assert engine._staging is prep.staging
    finally:
        engine.close()


def test_a_superseded_preparation_never_blocks_and_is_released(tmp_path: Path) -> None:
    rig = Rig(tmp_path / "ckpt", width=64)
    rig.train_step()
    first = rig.engine._prep
    assert first is not None
    bigger = rig.state.capture(step=0).tensors | {"extra/x": torch.zeros(1000)}
    rig.engine.prepare(bigger)  # other shapes: the first preparation is dropped without a join
    assert first.abandoned and rig.engine._prep is not first
    rig.engine.close()
    assert first.thread is not None and not first.thread.is_alive()
    assert first.staging is None  # released by its own thread or by the drop


def test_slots_built_before_a_failed_allocation_are_released(monkeypatch: pytest.MonkeyPatch) -> None:
    from hpcckpt.store import hostmem

    released: list[int] = []
    real_init, real_release = hostmem.Slot.__init__, hostmem.Slot.release

    def init(self: hostmem.Slot, nbytes: int, *, pin: bool, prefault: bool | None = None) -> None:
        if len(built) == 2:  # the third allocation fails (injected), as an exhausted pin would
            raise MemoryError("cannot allocate staging (injected)")
        real_init(self, nbytes, pin=pin, prefault=prefault)
        built.append(id(self))

    def release(self: hostmem.Slot) -> None:
        released.append(id(self))
        real_release(self)

    built: list[int] = []
    monkeypatch.setattr(hostmem.Slot, "__init__", init)
    monkeypatch.setattr(hostmem.Slot, "release", release)
    with pytest.raises(MemoryError, match="injected"):
        hostmem.make_slots(4, 8192, pin=False)
    assert len(built) == 2 and sorted(released) == sorted(built)


def test_resumed_optimizer_state_gets_a_gpu_home_only_where_its_parameters_are() -> None:
    from hpcckpt.engines.base import LiveTensors, live_tensors
    from hpcckpt.state import TrainState
    from hpcckpt.store import hdf5
    from hpcckpt.store.read import _home_devices

    model = torch.nn.Linear(3, 2)
    adam = torch.optim.Adam(model.parameters())
    model(torch.randn(1, 3)).sum().backward()
    adam.step()
    state = TrainState()
    state.register("model", model)
    state.register("adam", adam)
    flat = state.capture(step=1)
    entries = {n: hdf5.TensorEntry(n, str(t.numpy().dtype), tuple(t.shape), 0, t.numel() * t.element_size(), 0)
               for n, t in flat.tensors.items()}
    fresh = {n: t for n, t in flat.tensors.items() if "/state/" not in n}  # a resumed process: no state yet
    # The optimizer's own parameters decide (a CPU-offloaded optimizer keeps its state on the host),
    # not whether some live tensor is on a GPU.
    live = live_tensors(fresh, state.objects)
    assert live.optimizer_devices == {"adam": {torch.device("cpu")}}
    assert _home_devices(flat.meta, entries, live) == {}
    gpu = torch.device("cuda", 0)
    homes = _home_devices(flat.meta, entries, LiveTensors(fresh, {"adam": {gpu}}))
    assert sorted(homes) == sorted(n for n in flat.tensors if "/state/" in n and not n.endswith("/step"))
    assert set(homes.values()) == {gpu}
    assert _home_devices(flat.meta, entries, LiveTensors(fresh, {"adam": {gpu, torch.device("cpu")}})) == {}
    assert _home_devices(flat.meta, entries, fresh) == {}  # unknown: host memory, as torch would
