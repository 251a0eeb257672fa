"""A just-in-time checkpoint of a model of realistic size restores (issue 51, item 8).

The JIT writer puts every rank's tensors in one ``jit.pt``: the replicated ones (parameters,
optimizer state) listed in the writer's record only, each survivor's rank-local ones in its
own. The manifest's size bound once counted a single rank's tensors against that whole file:
any model above about a megabyte was called corrupt at resume and by ``verify``, and the
project's JIT tests passed only because their model was tiny. Here two gloo DDP ranks train
a ~21 MB MLP (44 parameter tensors, Adam: ~63 MB in the file), rank 1 is killed mid-step,
rank 0 writes the JIT checkpoint, and two fresh ranks resume from it on either engine and
end bit-identical to a run that was never interrupted.
"""
from __future__ import annotations

import json
import signal
from pathlib import Path
from typing import Any

import pytest

from hpcckpt.exitcodes import EXIT_REQUEUE
from hpcckpt.store import catalog
from hpcckpt.store.manifest import validate
from tests.helpers import built_once
from tests.unit.test_jit import _committed, _final, _same, run_job

pytestmark = pytest.mark.native

BIG = {"world": 2, "total": 10, "width": 512, "depth": 20}  # 5.26 M parameters: 21 MB, 44 tensors
STEP = 6


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> Path:
    def build(root: Path) -> None:
        codes, outs = run_job(root, **BIG)
        assert codes == [0, 0], "\n".join(outs)
    return built_once(tmp_path_factory, "jit-realistic-reference", build)


@pytest.mark.parametrize("engine", ["sync", "concurrent"])
def test_a_jit_checkpoint_of_a_realistic_model_restores_bit_identical(tmp_path: Path, reference: Path,
                                                                      engine: str) -> None:
    codes, outs = run_job(tmp_path, **BIG, engine=engine, victim=1, at=STEP, how="kill")
    assert codes[1] == -signal.SIGKILL and codes[0] == EXIT_REQUEUE, "\n".join(outs)
    assert _committed(tmp_path) == [STEP], "\n".join(outs)
    info = catalog.find(tmp_path / "ckpt", None)
    assert info.manifest is not None and info.manifest["engine"] == "jit"
    size = (info.path / "jit.pt").stat().st_size
    assert size >= 60 << 20, size  # parameters and Adam's two moments: a model of realistic size
    assert catalog.check(info.path, full=True)[1] == []  # what `hpcckpt verify` asks
    codes, outs = run_job(tmp_path, **BIG, engine=engine)
    assert codes == [0, 0], "\n".join(outs)
    for r in range(2):
        assert json.loads((tmp_path / f"result-{r}.json").read_text())["resumed"] == STEP, "\n".join(outs)
        assert _same(_final(tmp_path, r), _final(reference, r)), f"rank {r} differs from the uninterrupted run"


# -- the bound itself (no ranks started) ----------------------------------------------------

def _entry(nbytes: int) -> dict[str, Any]:
    return {"dtype": "uint8", "shape": [nbytes], "nbytes": nbytes, "crc32c": 0}


def _jit_manifest(file_bytes: int, *, world: int = 2, replicated: int = 40, each: int = 1 << 20) -> dict[str, Any]:
    """A JIT-shaped manifest: one torch file; rank 0's record lists ``replicated`` tensors of
    ``each`` bytes (and a small local one); every other rank's record lists one small local one."""
    rep = {f"objects/model/w{i}": _entry(each) for i in range(replicated)}
    ranks = {}
    for r in range(world):
        local = {f"jit/rank{r}/rng": _entry(5056)}
        ranks[str(r)] = {"file": "jit.pt", "format": "torch", "meta": None,
                         "tensors": {**(rep if r == 0 else {}), **local}}
    shared = {n: {"dtype": "uint8", "shape": [each], "kind": "replicated",
                  "pieces": [{"rank": 0, "start": 0, "nbytes": each}]} for n in rep}
    return {"format": "hpcckpt/4", "step": 3, "world_size": world, "ranks": ranks, "shared": shared,
            "files": {"jit.pt": {"bytes": file_bytes, "crc32c": 1}}}


def test_a_shared_file_is_bounded_by_every_rank_tensors_it_holds() -> None:
    # 40 MiB of replicated tensors in rank 0's record, a few KiB in rank 1's: the file's size is plausible
    validate(_jit_manifest(40 << 20 | 4096), step=3, meta=False)


def test_a_shared_file_larger_than_all_its_tensors_is_still_refused() -> None:
    from hpcckpt.errors import CheckpointCorrupt
    with pytest.raises(CheckpointCorrupt, match="plausible"):  # a crafted, sparse tebibyte
        validate(_jit_manifest(1 << 40), step=3, meta=False)
    # a name listed by several ranks counts once: the bound does not grow with the world size
    m = _jit_manifest(1 << 30, world=64, replicated=0)
    for rec in m["ranks"].values():
        rec["tensors"] = {"jit/rank0/big": _entry(1 << 20)}
    with pytest.raises(CheckpointCorrupt, match="plausible"):
        validate(m, step=3, meta=False)
