"""A resume trusts exactly what ``verify`` trusts, and falls back with a reason.

Each case damages or crafts the newest of two real sync checkpoints the way the third
hostile-input campaign did, then resumes through ``Checkpointer.register``: the damaged
step must be passed over (reason in the ledger), the one before it restored bit for
bit, and nothing read or sized from what the manifest does not back.
"""
from __future__ import annotations

import json
import re
import subprocess
import sys
import zipfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from hpcckpt import Checkpointer
from hpcckpt._core import crc32c
from hpcckpt.store import catalog
from hpcckpt.store.commit import MANIFEST, seal_manifest
from hpcckpt.store.manifest import decode
from tests.conftest import REPO

pytestmark = [pytest.mark.fault]


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Linear(4, 4)


def _train(root: Path, steps: int = 2) -> dict[int, dict[str, torch.Tensor]]:
    """Two committed sync checkpoints; the model's weights at each saved step."""
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    saved: dict[int, dict[str, torch.Tensor]] = {}
    with Checkpointer(root, engine="sync", every_steps=1, keep=5) as ck:
        ck.register(model=model, optimizer=opt)
        for step in ck.steps(steps):
            opt.zero_grad()
            model(torch.ones(1, 4)).sum().backward()
            opt.step()
            saved[step + 1] = {k: v.clone() for k, v in model.state_dict().items()}  # step-S: after S steps
    return saved


def _newest_two(root: Path) -> tuple[int, int]:
    good = [i.step for i in catalog.scan(root) if i.status == "committed"]
    assert len(good) >= 2, good
    return good[-2], good[-1]


def _resume(root: Path) -> tuple[int | None, torch.nn.Module, list[dict[str, Any]]]:
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with Checkpointer(root, engine="sync", every_steps=1000) as ck:
        step = ck.register(model=model, optimizer=opt)
    ledger = [json.loads(line) for line in (root / "ledger.jsonl").read_text().splitlines()]
    return step, model, [r for r in ledger if r.get("event") == "skip_corrupt"]


def _reseal(step_dir: Path, edit: Callable[[dict[str, Any]], None]) -> None:
    """Rewrite the manifest with ``edit`` applied and a valid self-checksum (a crafted one)."""
    manifest = json.loads((step_dir / MANIFEST).read_text())
    edit(manifest)
    (step_dir / MANIFEST).unlink()
    (step_dir / MANIFEST).write_bytes(seal_manifest(manifest))


def _assert_fell_back(root: Path, good: int, bad: int, saved: dict[int, dict[str, torch.Tensor]],
                      reason: str) -> None:
    step, model, skips = _resume(root)
    assert step == good, f"resumed {step}, expected the fallback to {good}"
    for k, v in model.state_dict().items():
        assert torch.equal(v, saved[good][k]), k
    assert [s["step"] for s in skips] == [bad] and reason in skips[0]["problem"], skips


def test_a_tampered_pickle_is_never_resumed(tmp_path: Path) -> None:
    """Same size, same bytes of every tensor, manifest untouched: only the pickle says int32.
    verify calls it corrupt; the resume must too (the whole-file crc32c), not load it."""
    saved = _train(tmp_path)
    good, bad = _newest_two(tmp_path)
    path = tmp_path / f"step-{bad}" / "rank-0.pt"
    raw = bytearray(path.read_bytes())
    info = next(i for i in zipfile.ZipFile(path).infolist() if i.filename.endswith("data.pkl"))
    start = info.header_offset + 30 + len(info.filename.encode()) + len(info.extra)
    pkl = bytes(raw[start:start + info.file_size])
    # float32 -> int32 (same bytes, same size): the global is 2 bytes shorter, so the storage's
    # numel and offset (BININT1) are re-encoded as BININT2, 1 byte longer each.
    forged = re.sub(rb"ctorch\nFloatStorage\n(.*?cpu(?:q.|r....))K(.)t(q.|r....)QK(.)",
                    rb"ctorch\nIntStorage\n\1M\2\0t\3QM\4\0", pkl, count=1, flags=re.S)
    assert forged != pkl and len(forged) == len(pkl)
    raw[start:start + info.file_size] = forged
    path.write_bytes(raw)
    verify = subprocess.run([sys.executable, "-m", "hpcckpt.cli", "verify", str(tmp_path), "--step", str(bad)],
                            capture_output=True, text=True, cwd=REPO, timeout=300, check=False)
    assert verify.returncode != 0 and "crc32c" in verify.stdout + verify.stderr, verify.stdout + verify.stderr
    _assert_fell_back(tmp_path, good, bad, saved, "crc32c")


def test_garbage_rng_state_falls_back_with_a_reason(tmp_path: Path) -> None:
    saved = _train(tmp_path)
    good, bad = _newest_two(tmp_path)

    def garbage_rng(m: dict[str, Any]) -> None:
        m["ranks"]["0"]["meta"]["rng"]["python"] = [3, [1, 2, 3], None]  # not a Mersenne Twister state
    _reseal(tmp_path / f"step-{bad}", garbage_rng)
    _assert_fell_back(tmp_path, good, bad, saved, "RNG state")


def test_a_shape_that_differs_from_the_model_falls_back(tmp_path: Path) -> None:
    """The newest step was saved by a model of another shape (copied in, manifest re-sealed)."""
    saved = _train(tmp_path)
    good, bad = _newest_two(tmp_path)
    other = tmp_path.parent / "other"
    model = torch.nn.Linear(4, 3)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with Checkpointer(other, engine="sync", every_steps=1) as ck:
        ck.register(model=model, optimizer=opt)
        for _ in ck.steps(1):
            opt.zero_grad()
            model(torch.ones(1, 4)).sum().backward()
            opt.step()
    donor = [i.path for i in catalog.scan(other) if i.status == "committed"]
    assert donor, "the donor run committed nothing"
    target = tmp_path / f"step-{bad}"
    (target / "rank-0.pt").unlink()
    (target / "rank-0.pt").write_bytes((donor[-1] / "rank-0.pt").read_bytes())
    donor_manifest = json.loads((donor[-1] / MANIFEST).read_text())

    def other_shape(m: dict[str, Any]) -> None:
        rec = donor_manifest["ranks"]["0"]
        rec["meta"]["step"] = bad
        m["ranks"]["0"] = rec
        m["files"] = donor_manifest["files"]
    _reseal(target, other_shape)
    _assert_fell_back(tmp_path, good, bad, saved, "cannot be restored into the model")


def test_a_stride0_view_never_allocates_its_view(tmp_path: Path) -> None:
    """A 2^28-float stride-0 view over a 4-byte storage, in a small archive whose manifest
    was re-sealed to match it: verify and the resume refuse it before any checksum
    makes it contiguous (that was 1 GiB), and the resume falls back."""
    saved = _train(tmp_path)
    good, bad = _newest_two(tmp_path)
    target = tmp_path / f"step-{bad}"
    manifest = decode(json.loads((target / MANIFEST).read_text()))
    names = list(manifest["ranks"]["0"]["tensors"])
    archive = torch.load(target / "rank-0.pt", weights_only=True)
    archive["tensors"][names[0]] = torch.zeros(1).expand(1 << 28)
    (target / "rank-0.pt").unlink()
    torch.save(archive, target / "rank-0.pt")
    data = (target / "rank-0.pt").read_bytes()
    assert len(data) < 100_000

    def match_archive(m: dict[str, Any]) -> None:
        info = {"bytes": len(data), "crc32c": crc32c(data)}
        m["files"]["rank-0.pt"] = info
        m["ranks"]["0"]["file_info"] = info
        # No recorded offsets (a manifest written before they were): the archive's own index
        # is what places the tensors, and it is what must refuse the view.
        m["ranks"]["0"]["tensor_table"].pop("offset")
    _reseal(target, match_archive)
    probe = ("import resource, sys\nfrom hpcckpt.store import catalog\n"
             f"info = catalog.inspect_step(__import__('pathlib').Path({str(tmp_path)!r}), {bad}, full=True)\n"
             "print(info.status, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)\n")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, cwd=REPO, timeout=300,
                         check=True).stdout.split()
    status, peak_kib = out[0], int(out[1])
    assert status == "corrupt"
    assert peak_kib < 900 * 1024, f"verify peaked at {peak_kib // 1024} MiB: the 1 GiB view was materialised"
    _assert_fell_back(tmp_path, good, bad, saved, "storage")


# --- state a registered object refuses: the checkpoint's, or the user's code (issue 29 item 3) ---

def _optimizer(m: dict[str, Any]) -> dict[str, Any]:
    opt: dict[str, Any] = m["ranks"]["0"]["meta"]["objects"]["optimizer"]
    return opt


@pytest.mark.parametrize("garbage", ["param_groups", "params", "state"])
def test_garbage_optimizer_state_falls_back_with_a_reason(tmp_path: Path, garbage: str) -> None:
    """A re-sealed manifest (it verifies) whose optimizer metadata the optimizer refuses: the step
    before is restored and the ledger says why, instead of register() failing."""
    saved = _train(tmp_path)
    good, bad = _newest_two(tmp_path)

    def damage(m: dict[str, Any]) -> None:
        if garbage == "param_groups":
            _optimizer(m)["param_groups"] = "garbage"
        elif garbage == "params":
            _optimizer(m)["param_groups"][0]["params"] = "garbage"
        else:
            _optimizer(m)["state"] = 5
    _reseal(tmp_path / f"step-{bad}", damage)
    _assert_fell_back(tmp_path, good, bad, saved, "cannot restore optimizer")


def _train_with_sampler(root: Path) -> dict[int, dict[str, torch.Tensor]]:
    from hpcckpt.data import ResumableSampler
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    sampler = ResumableSampler(16, seed=1)
    saved: dict[int, dict[str, torch.Tensor]] = {}
    with Checkpointer(root, engine="sync", every_steps=1, keep=5) as ck:
        ck.register(model=model, optimizer=opt, sampler=sampler)
        for step in ck.steps(3):
            sampler.advance(2)
            opt.zero_grad()
            model(torch.ones(1, 4)).sum().backward()
            opt.step()
            saved[step + 1] = {k: v.clone() for k, v in model.state_dict().items()}
    return saved


@pytest.mark.parametrize("field, value, reason", [
    ("sampler", {"consumed": "lots"}, "non-integer"),
    ("sampler", {"epoch": -3}, "inconsistent"),
    ("sampler", {"seed": None}, "non-integer"),
    ("__progress__", {"finished": "maybe"}, "progress state is damaged"),
    ("__progress__", {"loaders": {"train": {"passes": 1}}}, "lacks"),
])
def test_garbage_sampler_or_progress_state_falls_back_with_a_reason(
        tmp_path: Path, field: str, value: dict[str, Any], reason: str) -> None:
    from hpcckpt.data import ResumableSampler
    saved = _train_with_sampler(tmp_path)
    good, bad = _newest_two(tmp_path)

    def damage(m: dict[str, Any]) -> None:
        m["ranks"]["0"]["meta"]["objects"][field].update(value)
    _reseal(tmp_path / f"step-{bad}", damage)
    model = _model()
    sampler = ResumableSampler(16, seed=1)
    with Checkpointer(tmp_path, engine="sync", every_steps=1000) as ck:
        step = ck.register(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1), sampler=sampler)
    assert step == good
    assert sampler.consumed == 2 * good
    for k, v in model.state_dict().items():
        assert torch.equal(v, saved[good][k]), k
    ledger = [json.loads(line) for line in (tmp_path / "ledger.jsonl").read_text().splitlines()]
    skips = [r for r in ledger if r.get("event") == "skip_corrupt"]
    assert [s["step"] for s in skips] == [bad] and reason in skips[0]["problem"], skips


def test_a_model_every_checkpoint_refuses_alike_says_what_to_do(tmp_path: Path) -> None:
    """The user's code changed (a layer added): every checkpoint is refused the same way. That is
    a ConfigError saying what to do, not 'every checkpoint damaged', and nothing is pruned."""
    from hpcckpt.errors import ConfigError
    _train(tmp_path)
    before = sorted(p.name for p in tmp_path.glob("step-*"))
    model = torch.nn.Sequential(_model(), torch.nn.Linear(4, 4))
    with Checkpointer(tmp_path, engine="sync", every_steps=1000) as ck:
        with pytest.raises(ConfigError, match=r"(?s)cannot restore model .*Register an object built as in the run "
                                              r"that saved it.*refused the same way: steps"):
            ck.register(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
    assert sorted(p.name for p in tmp_path.glob("step-*")) == before
    assert "skip_corrupt" not in (tmp_path / "ledger.jsonl").read_text()  # nothing was damaged


def test_a_changed_param_group_layout_is_not_passed_over(tmp_path: Path) -> None:
    """Parameter groups that differ from the newest checkpoint's are this job's optimizer, not
    damage: the resume stops with what to do instead of falling back to an older step."""
    from hpcckpt.errors import ConfigError
    _train(tmp_path)
    model = _model()
    head = torch.nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    opt.add_param_group({"params": head.parameters(), "lr": 0.01})
    with Checkpointer(tmp_path, engine="sync", every_steps=1000) as ck:
        with pytest.raises(ConfigError, match=r"1 parameter group\(s\).*now has 2.*add_param_group"):
            ck.register(model=model, optimizer=opt)
    assert "skip_corrupt" not in (tmp_path / "ledger.jsonl").read_text()
