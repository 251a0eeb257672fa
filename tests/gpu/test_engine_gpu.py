"""The concurrent engine and the restore on a real GPU (``pytest -m gpu``; skipped without CUDA).

Pinned staging prepared off the step path and released on close; D2H on the side
stream, bit-exact with full slots and with a staging ring of 25% of the state;
restore lands in the live CUDA parameters and optimizer state, checksums verified.
"""
from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from hpcckpt.api import Checkpointer
from hpcckpt.engines import SaveContext, load_rank
from hpcckpt.engines.base import live_tensors
from hpcckpt.engines.concurrent import ConcurrentEngine
from hpcckpt.errors import CheckpointCorrupt, ConfigError
from hpcckpt.ranks import Ranks
from hpcckpt.state import TrainState
from hpcckpt.store import catalog

pytestmark = pytest.mark.gpu


def make_model(width: int) -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(width, width), torch.nn.BatchNorm1d(width), torch.nn.ReLU(),
                               torch.nn.Linear(width, 4)).cuda()


class CudaRig:
    def __init__(self, root: Path, width: int = 512, keep: int = 50, **options: object) -> None:
        self.root, self.width = root, width
        self.model = make_model(width)
        self.opt = torch.optim.Adam(self.model.parameters(), lr=1e-3)
        self.state = TrainState()
        self.state.register("model", self.model)
        self.state.register("optimizer", self.opt)
        self.engine = ConcurrentEngine(SaveContext(root=root, keep=keep, job={}, user={}), Ranks(), **options)
        self.engine.bind(self.state)

    def train_step(self) -> None:
        x = torch.randn(16, self.width, device="cuda")
        self.opt.zero_grad()
        self.model(x).square().mean().backward()
        self.opt.step()

    def snapshot(self, step: int) -> dict[str, torch.Tensor]:
        torch.cuda.synchronize()
        return {n: t.detach().cpu().clone() for n, t in self.state.capture(step=step).tensors.items()}

    def prepared(self) -> None:
        prep = self.engine._prep
        if prep is not None and prep.thread is not None:
            prep.thread.join(timeout=120)

    def state_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.state.capture(step=0).tensors.values())


@pytest.fixture
def cleanup() -> Iterator[list[ConcurrentEngine]]:
    engines: list[ConcurrentEngine] = []
    yield engines
    for e in engines:
        e.close()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()


def assert_same_cpu(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert got.keys() == want.keys()
    for name, t in want.items():
        assert torch.equal(got[name].cpu(), t), name


def test_saving_every_step_overwrites_a_pruned_rank_file_and_stays_exact(
        tmp_path: Path, cleanup: list[ConcurrentEngine]) -> None:
    """A small GPU state saved at every step, as a user's loop does (keep=2): the launcher
    starts each save's writes when its D2H is done, the rank file of a pruned checkpoint is
    overwritten (metadata included) instead of made afresh, and every checkpoint kept
    restores bit-exact."""
    rig = CudaRig(tmp_path / "ckpt", width=256, keep=2)
    cleanup.append(rig.engine)
    rig.train_step()
    rig.prepared()
    wants, handles = {}, []
    for step in range(1, 13):
        wants[step] = rig.snapshot(step)
        handles.append(rig.engine.save(rig.state.capture(step=step), step))
        rig.train_step()
    for h in handles:
        assert h.wait(timeout=300)
    assert [i.step for i in catalog.scan(rig.root)] == [11, 12]
    for step in (11, 12):
        assert_same_cpu(load_rank(catalog.find(rig.root, step), 0, 1).tensors, wants[step])
    assert rig.engine._recycler is not None and rig.engine._recycler.reused >= 5
    launcher = rig.engine._launcher
    assert launcher is not None and launcher.is_alive()
    rig.engine.close()
    assert not launcher.is_alive()


@pytest.mark.parametrize("share", [None, 0.25])
def test_cuda_saves_are_bit_exact_with_pinned_staging_released_on_close(
        tmp_path: Path, share: float | None, cleanup: list[ConcurrentEngine]) -> None:
    probe = CudaRig(tmp_path / "probe")
    cleanup.append(probe.engine)
    probe.train_step()
    budget = None if share is None else int(probe.state_bytes() * share)
    rig = CudaRig(tmp_path / "ckpt", staging_bytes=budget, chunk_bytes=256 << 10)
    cleanup.append(rig.engine)
    rig.train_step()
    rig.prepared()
    wants, handles = {}, []
    for step in range(1, 5):
        wants[step] = rig.snapshot(step)
        handles.append(rig.engine.save(rig.state.capture(step=step), step))
        rig.train_step()  # overlaps the D2H; its optimizer.step() is ordered after it
    for h in handles:
        assert h.wait(timeout=300)
    for step, want in wants.items():
        assert_same_cpu(load_rank(catalog.find(rig.root, step), 0, 1).tensors, want)
    st = rig.engine.stats
    assert st.staging_pinned is True and st.d2h_bytes > 0 and st.d2h_s > 0
    if share is not None:
        assert st.ring_chunks >= 1 and 0 < st.staging_bytes <= budget
    staging = rig.engine._staging
    assert staging is not None
    buffers = staging.ring.chunks if staging.ring else staging.slots
    assert buffers and all(b.pinned for b in buffers)
    rig.engine.close()
    assert all(not b.pinned for b in buffers)  # cudaHostUnregister'ed
    assert rig.engine._staging is None and rig.engine.stats.staging_bytes == 0


def test_first_save_uses_staging_pinned_in_the_background(tmp_path: Path, cleanup: list[ConcurrentEngine]) -> None:
    rig = CudaRig(tmp_path / "ckpt")
    cleanup.append(rig.engine)
    rig.train_step()
    prep = rig.engine._prep
    assert prep is not None
    rig.prepared()
    assert prep.staging is not None and prep.staging.pinned
    rig.engine.save(rig.state.capture(step=1), 1).wait(timeout=300)
    assert rig.engine._staging is prep.staging


def test_restore_lands_in_the_live_cuda_tensors(tmp_path: Path, cleanup: list[ConcurrentEngine]) -> None:
    rig = CudaRig(tmp_path / "ckpt", width=1024)
    cleanup.append(rig.engine)
    for _ in range(3):
        rig.train_step()
    want = rig.snapshot(3)
    rig.engine.save(rig.state.capture(step=3), 3).wait(timeout=300)
    rig.train_step()  # the live state moves on; the restore must bring step 3 back
    live = rig.state.capture(step=0).tensors
    stats: dict[str, object] = {}
    got = load_rank(catalog.find(rig.root, 3), 0, 1, into=live, stats=stats).tensors
    weight = "objects/model/0.weight"
    assert got[weight] is live[weight] and got[weight].is_cuda
    assert isinstance(stats["device_bytes"], int) and stats["device_bytes"] > 0
    assert_same_cpu(got, want)
    assert torch.equal(rig.model[0].weight.detach().cpu(), want[weight])


def test_restore_onto_the_gpu_names_a_damaged_tensor(tmp_path: Path, cleanup: list[ConcurrentEngine]) -> None:
    rig = CudaRig(tmp_path / "ckpt")
    cleanup.append(rig.engine)
    rig.train_step()
    handle = rig.engine.save(rig.state.capture(step=1), 1)
    handle.wait(timeout=300)
    _, entries = catalog.rank_entries(catalog.find(rig.root, 1).manifest or {}, 0)
    e = entries["objects/model/0.weight"]
    assert handle.path is not None
    with open(handle.path / "rank-0.h5", "r+b") as f:
        f.seek(e.offset + e.nbytes // 2)
        byte = f.read(1)
        f.seek(e.offset + e.nbytes // 2)
        f.write(bytes([byte[0] ^ 0x10]))
    with pytest.raises(CheckpointCorrupt, match="0.weight"):
        load_rank(catalog.find(rig.root, 1), 0, 1, into=rig.state.capture(step=0).tensors)


def test_checkpointer_resume_restores_cuda_parameters_in_place(tmp_path: Path) -> None:
    root = tmp_path / "ckpt"
    model = make_model(256)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    with Checkpointer(root, engine="concurrent", staging_bytes=64 << 10) as ck:
        ck.register(model=model, optimizer=opt)
        for _ in ck.steps(3):
            opt.zero_grad()
            model(torch.randn(8, 256, device="cuda")).square().mean().backward()
            opt.step()
        ck.save(block=True)
    torch.cuda.synchronize()
    want = {n: p.detach().cpu().clone() for n, p in model.state_dict().items()}
    model2 = make_model(256)
    opt2 = torch.optim.Adam(model2.parameters(), lr=1e-3)  # a resumed process: no optimizer state yet
    ptrs = {n: p.data_ptr() for n, p in model2.named_parameters()}
    with Checkpointer(root, engine="concurrent") as ck2:
        assert ck2.register(model=model2, optimizer=opt2) == 3
    assert {n: p.data_ptr() for n, p in model2.named_parameters()} == ptrs
    for n, t in model2.state_dict().items():
        assert torch.equal(t.cpu(), want[n]), n
    assert len(opt2.state) == len(opt.state)
    for s1, s2 in zip(opt.state.values(), opt2.state.values()):
        for key in ("exp_avg", "exp_avg_sq", "step"):
            assert torch.equal(s1[key].cpu(), s2[key].cpu()), key
        assert s2["exp_avg"].is_cuda and s2["exp_avg_sq"].is_cuda  # read through the pinned pipeline
        assert s2["step"].device == s1["step"].device  # where torch keeps it (CPU unless capturable)


def test_optimizer_state_of_a_fresh_optimizer_is_read_onto_the_gpu(tmp_path: Path,
                                                                   cleanup: list[ConcurrentEngine]) -> None:
    rig = CudaRig(tmp_path / "ckpt")
    cleanup.append(rig.engine)
    rig.train_step()
    want = rig.snapshot(1)
    rig.engine.save(rig.state.capture(step=1), 1).wait(timeout=300)
    model = make_model(rig.width)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    state = TrainState()
    state.register("model", model)
    state.register("optimizer", opt)
    stats: dict[str, object] = {}
    flat = load_rank(catalog.find(rig.root, 1), 0, 1, into=live_tensors(state.capture(step=0).tensors, state.objects),
                     stats=stats)
    state_names = [n for n in flat.tensors if n.startswith("objects/optimizer/state/")]
    assert state_names
    for n in state_names:
        assert flat.tensors[n].is_cuda == (not n.endswith("/step")), n
    assert_same_cpu(flat.tensors, want)
    live = sum(t.numel() * t.element_size() for t in state.capture(step=0).tensors.values())
    in_place, device = stats["in_place_bytes"], stats["device_bytes"]
    assert isinstance(in_place, int) and isinstance(device, int)
    assert in_place <= live < device  # the new GPU homes are read on the device, not counted as overwritten
    state.restore(flat)
    assert all(s["exp_avg"].is_cuda for s in opt.state.values())


def test_adam_step_counters_are_those_of_the_saved_step(tmp_path: Path, cleanup: list[ConcurrentEngine]) -> None:
    """Default Adam keeps ``step`` on the CPU for CUDA parameters and bumps it on the host in
    optimizer.step(), whose pre-hook does not wait on the host for the D2H: save() must have
    staged those counters already, or step S's parameters would be saved with S+1's counters."""
    rig = CudaRig(tmp_path / "ckpt", width=1024)
    cleanup.append(rig.engine)
    for _ in range(3):
        rig.train_step()
    rig.prepared()
    want = rig.snapshot(3)
    steps = [n for n in want if n.startswith("objects/optimizer/state/") and n.endswith("/step")]
    live = rig.state.capture(step=3).tensors
    assert steps and not any(live[n].is_cuda for n in steps)  # the mixed case under test
    handle = rig.engine.save(rig.state.capture(step=3), 3)
    rig.train_step()  # at once: the step counters move to 4 on the host
    rig.train_step()
    handle.wait(timeout=300)
    got = load_rank(catalog.find(rig.root, 3), 0, 1).tensors
    assert all(float(got[n]) == 3.0 for n in steps), {n: float(got[n]) for n in steps}
    assert_same_cpu(got, want)


def test_a_cpu_offloaded_optimizer_resumes_with_its_state_on_the_host(tmp_path: Path) -> None:
    root = tmp_path / "ckpt"

    def build() -> tuple[torch.nn.Module, list[torch.Tensor], torch.optim.Optimizer]:
        model = make_model(128)
        master = [p.detach().cpu().clone().requires_grad_(True) for p in model.parameters()]
        return model, master, torch.optim.Adam(master, lr=1e-3)

    def offloaded_step(model: torch.nn.Module, master: list[torch.Tensor], opt: torch.optim.Optimizer) -> None:
        model.zero_grad()
        model(torch.randn(8, 128, device="cuda")).square().mean().backward()
        for m, p in zip(master, model.parameters()):
            m.grad = p.grad.detach().cpu()
        opt.step()
        with torch.no_grad():
            for m, p in zip(master, model.parameters()):
                p.copy_(m)

    model, master, opt = build()
    with Checkpointer(root, engine="concurrent") as ck:
        ck.register(model=model, optimizer=opt)
        for _ in ck.steps(2):
            offloaded_step(model, master, opt)
        ck.save(block=True)
    model2, _, opt2 = build()
    fresh = TrainState()
    fresh.register("model", model2)
    fresh.register("optimizer", opt2)
    stats: dict[str, object] = {}
    flat = load_rank(catalog.find(root, 2), 0, 1, into=live_tensors(fresh.capture(step=0).tensors, fresh.objects),
                     stats=stats)
    state_names = [n for n in flat.tensors if n.startswith("objects/optimizer/state/")]
    assert state_names and not any(flat.tensors[n].is_cuda for n in state_names)  # no GPU memory for them
    assert flat.tensors["objects/model/0.weight"].is_cuda  # the model still restores onto its GPU
    with Checkpointer(root, engine="concurrent") as ck2:
        assert ck2.register(model=model2, optimizer=opt2) == 2
    assert len(opt2.state) == len(opt.state)
    for s1, s2 in zip(opt.state.values(), opt2.state.values()):
        assert not s2["exp_avg"].is_cuda and not s2["exp_avg_sq"].is_cuda  # where its parameters are
        assert torch.equal(s1["exp_avg"], s2["exp_avg"])


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")
def test_tensors_on_two_gpus_are_refused_when_saving_and_restoring(tmp_path: Path) -> None:
    a, b = torch.nn.Linear(8, 8).to("cuda:0"), torch.nn.Linear(8, 8).to("cuda:1")
    state = TrainState()
    state.register("a", a)
    state.register("b", b)
    engine = ConcurrentEngine(SaveContext(root=tmp_path / "ckpt", keep=2, job={}, user={}), Ranks())
    try:
        with pytest.raises(ConfigError, match="cuda:0, cuda:1"):
            engine.save(state.capture(step=1), 1)
    finally:
        engine.close()
    with Checkpointer(tmp_path / "one", engine="concurrent") as ck:  # saved from one device
        ck.register(a=a, b=torch.nn.Linear(8, 8).to("cuda:0"))
        ck.save(block=True)
    with pytest.raises(ConfigError, match="cuda:0, cuda:1.*one rank per GPU"):
        load_rank(catalog.find(tmp_path / "one", None), 0, 1, into=state.capture(step=0).tensors)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")
def test_training_on_a_device_that_is_not_the_current_one_saves_exactly(tmp_path: Path,
                                                                        cleanup: list[ConcurrentEngine]) -> None:
    torch.cuda.set_device(0)
    model = torch.nn.Linear(256, 256).to("cuda:1")
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    state = TrainState()
    state.register("model", model)
    state.register("optimizer", opt)
    engine = ConcurrentEngine(SaveContext(root=tmp_path / "ckpt", keep=5, job={}, user={}), Ranks())
    cleanup.append(engine)
    engine.bind(state)

    def step() -> None:
        opt.zero_grad()
        model(torch.randn(8, 256, device="cuda:1")).square().mean().backward()
        opt.step()

    step()
    torch.cuda.synchronize(1)
    want = {n: t.detach().cpu().clone() for n, t in state.capture(step=1).tensors.items()}
    handle = engine.save(state.capture(step=1), 1)
    step()  # the pre-hook orders cuda:1's stream after the D2H, not cuda:0's
    handle.wait(timeout=300)
    assert_same_cpu(load_rank(catalog.find(tmp_path / "ckpt", 1), 0, 1).tensors, want)
