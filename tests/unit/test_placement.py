"""Who writes which bytes (store.placement) and how a hpcckpt/2 manifest's shared table is checked.

Pure functions over real tensors: every rank's plan is computed here for world sizes
1..7, as each rank would compute it alone, and merged the way the coordinator's
commit does.
"""
from __future__ import annotations

import copy
import random
from typing import Any

import pytest
import torch

from hpcckpt.errors import CheckpointFailed
from hpcckpt.store import manifest as manifest_mod
from hpcckpt.store.manifest import Invalid, validate
from hpcckpt.store.placement import SPLIT_MIN_BYTES, Placement, plan, record_fields
from hpcckpt.store.shared import merge_shared, state_bytes, written_bytes


def _records(tensors: dict[str, torch.Tensor], world: int, replicated: set[str]) -> list[dict[str, Any]]:
    """Each rank's commit record as an engine builds it (file offsets made up, crc of the piece)."""
    records = []
    for rank in range(world):
        p = plan(tensors, Placement(rank, world, frozenset(replicated)))
        entries, offset = {}, 4096
        for name, t in p.tensors.items():
            nbytes = t.numel() * t.element_size()
            entries[name] = {"dtype": str(t.dtype).removeprefix("torch."), "shape": list(t.shape),
                             "offset": offset, "nbytes": nbytes, "crc32c": 0}
            offset += max(nbytes, 1)
        records.append({"file": f"rank-{rank}.h5", "format": "hdf5", "tensors": entries,
                        "file_info": {"bytes": offset},
                        "meta": {"step": 1, "objects": {}, "refs": [{"__tensor__": n} for n in tensors]},
                        **record_fields(p, coordinator=rank == 0)})
    return records


def _state(seed: int) -> dict[str, torch.Tensor]:
    rng = random.Random(seed)
    sizes = [0, 1, 3, 100, 5000, 70_000, 300_000, 900_000]
    out = {f"objects/model/t{i}": torch.empty(rng.choice(sizes)) for i in range(rng.randint(1, 25))}
    out["objects/model/scalar"] = torch.tensor(2.5)
    out["rng/torch"] = torch.zeros(16, dtype=torch.uint8)  # local: never in the shared table
    return out


@pytest.mark.parametrize("seed", range(12))
@pytest.mark.parametrize("world", [2, 3, 4, 7])
def test_replicated_bytes_are_written_once_and_balanced(seed: int, world: int) -> None:
    tensors = _state(seed)
    replicated = {n for n in tensors if n.startswith("objects/")}
    records = _records(tensors, world, replicated)
    m = manifest_mod.build(step=1, engine="concurrent", job={}, user={}, records=copy.deepcopy(records))
    validate(m, step=1)  # pieces tile every tensor, each held by its writer
    assert set(m["shared"]) == replicated
    total = sum(t.numel() * t.element_size() for n, t in tensors.items() if n in replicated)
    per_rank = [sum(e["nbytes"] for n, e in r["tensors"].items() if n in replicated) for r in records]
    assert sum(per_rank) == total  # once, not world times
    small = max([t.numel() * t.element_size() for n, t in tensors.items()
                 if n in replicated and t.numel() * 4 < SPLIT_MIN_BYTES], default=0)
    # Balanced up to one small tensor dealt whole (large ones are cut to fill the shares).
    assert max(per_rank) - min(per_rank) <= small + 4 * world, per_rank
    assert written_bytes(m) == {r: per_rank[r] + 16 for r in range(world)}
    assert state_bytes(m) == total + 16
    for name, spec in m["shared"].items():  # at most one piece per tensor per rank
        ranks = [p["rank"] for p in spec["pieces"]]
        assert len(ranks) == len(set(ranks)), (name, ranks)


def test_one_rank_writes_everything_as_local_tensors() -> None:
    tensors = _state(3)
    p = plan(tensors, Placement(0, 1, frozenset(tensors)))
    assert p.shared == {} and p.pieces == {} and set(p.tensors) == set(tensors)


def test_pieces_alias_live_memory_and_cover_the_tensor() -> None:
    big = torch.arange(600_000, dtype=torch.float32)
    parts = [plan({"w": big}, Placement(r, 3, frozenset({"w"}))) for r in range(3)]
    assert all(p.tensors["w"].data_ptr() == big.data_ptr() + p.pieces["w"] for p in parts)
    assert torch.equal(torch.cat([p.tensors["w"] for p in parts]), big)


def test_ranks_that_planned_other_tensors_fail_the_commit() -> None:
    tensors = _state(5)
    records = _records(tensors, 2, {n for n in tensors if n.startswith("objects/")})
    odd = _records({**tensors, "objects/model/extra": torch.zeros(4)}, 2,
                   {n for n in tensors if n.startswith("objects/")} | {"objects/model/extra"})
    with pytest.raises(CheckpointFailed, match=r"ranks \[1\] captured other distributed tensors"):
        merge_shared([records[0], odd[1]])


def _valid_manifest() -> dict[str, Any]:
    tensors = {"objects/model/w": torch.empty(400_000), "objects/model/b": torch.empty(10)}
    m = manifest_mod.build(step=1, engine="sync", job={}, user={}, records=_records(tensors, 2, set(tensors)))
    validate(m, step=1)
    return m


def _split(m: dict[str, Any]) -> dict[str, Any]:
    return m["shared"]["objects/model/w"]


CASES = {
    "overlap": (lambda m: _split(m)["pieces"][1].update(start=_split(m)["pieces"][1]["start"] - 4),
                "overlap"),
    "gap": (lambda m: _split(m)["pieces"][1].update(start=_split(m)["pieces"][1]["start"] + 4), "uncovered"),
    "missing piece": (lambda m: _split(m)["pieces"].pop(), "cover"),
    "rank out of range": (lambda m: _split(m)["pieces"][0].update(rank=5), "rank"),
    "piece not in its file": (lambda m: m["ranks"]["0"]["tensors"].pop("objects/model/w"), "holds no"),
    "unknown kind": (lambda m: _split(m).update(kind="mirrored"), "kind"),
    "bad dtype": (lambda m: _split(m).update(dtype="object"), "dtype"),
    "shape past its bytes": (lambda m: _split(m).update(shape=[400_001]), "cover"),
    "unknown format": (lambda m: m.update(format="hpcckpt/9"), "upgrade hpcckpt"),
    "one rank named for two pieces": (lambda m: _split(m)["pieces"][1].update(rank=_split(m)["pieces"][0]["rank"]),
                                      "two pieces"),
    "dangling reference": (lambda m: m["shared"].pop("objects/model/b"), "does not hold"),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_crafted_shared_tables_are_refused_by_name(case: str) -> None:
    m = _valid_manifest()
    change, words = CASES[case]
    change(m)
    with pytest.raises(Invalid, match=words):
        validate(m, step=1)


def test_check_replicas_refuses_tensors_that_differ_between_ranks() -> None:
    """The debug mode: declared replicas are checksummed whole and compared at the commit."""
    same = {"objects/model/w": torch.arange(10.0), "objects/model/b": torch.ones(3)}
    other = {"objects/model/w": torch.arange(10.0), "objects/model/b": torch.ones(3) * 2}

    def record(tensors: dict[str, torch.Tensor], rank: int) -> dict[str, Any]:
        p = plan(tensors, Placement(rank, 2, frozenset(tensors)), fingerprint=True)
        assert set(p.fingerprints) == set(tensors)
        entries = {n: {"nbytes": t.numel() * t.element_size()} for n, t in p.tensors.items()}
        return {"tensors": entries, **record_fields(p, coordinator=rank == 0)}

    merge_shared([record(same, 0), record(same, 1)])  # true replicas commit
    with pytest.raises(CheckpointFailed, match=r"'objects/model/b' is declared replicated but its bytes differ "
                                               r"between rank 0 and rank 1.*replicated='none'"):
        merge_shared([record(same, 0), record(other, 1)])


def test_parameters_ddp_ignores_stay_local() -> None:
    """DDP leaves ignored parameters unsynchronised: each rank keeps (and restores) its own."""
    from hpcckpt.state import TrainState
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
    model._ddp_params_and_buffers_to_ignore = ["1.bias"]  # what DDP's ignore helper sets
    opt_all = torch.optim.SGD(model.parameters(), lr=0.1)
    opt_synced = torch.optim.SGD([p for n, p in model.named_parameters() if n != "1.bias"], lr=0.1)
    state = TrainState()
    state.register("model", model)
    state.register("opt_all", opt_all)
    state.register("opt_synced", opt_synced)
    state.rank, state.world, state.replicated = 0, 2, "models"
    where = state.placement()
    assert where.is_replicated("objects/model/0.weight") and where.is_replicated("objects/model/1.weight")
    assert not where.is_replicated("objects/model/1.bias")
    # An optimizer over an unsynchronised parameter is not a replica either.
    assert where.is_replicated("objects/opt_synced/state/0/momentum_buffer")
    assert not where.is_replicated("objects/opt_all/state/0/momentum_buffer")


def test_committing_and_reading_a_shared_table_imports_no_torch() -> None:
    """The manifest of a distributed save is built (``shared.merge_shared``) and checked
    (``manifest.validate``, which ``ls``, ``verify`` and the epilog's scavenge run) without
    importing torch: that import costs a process ~2 CPU-seconds."""
    import json
    import subprocess
    import sys
    m = _valid_manifest()
    records = [dict(m["ranks"][str(r)]) for r in range(2)]
    for r, rec in enumerate(records):  # back to what the ranks sent: their pieces and the table
        rec["pieces"] = {p_name: p["start"] for p_name, spec in m["shared"].items()
                         for p in spec["pieces"] if p["rank"] == r}
        rec["shared"] = {n: {k: v for k, v in spec.items() if k != "pieces"} for n, spec in m["shared"].items()}
    code = ("import json, sys\n"
            "from hpcckpt.store import manifest\n"
            "records = json.loads(sys.stdin.read())\n"
            "m = manifest.build(step=1, engine='sync', job={}, user={}, records=records)\n"
            "manifest.validate(m, step=1)\n"
            "print(sorted(m['shared']), 'torch' in sys.modules)\n")
    out = subprocess.run([sys.executable, "-c", code], input=json.dumps(records), capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["['objects/model/b',", "'objects/model/w']", "False"], out.stdout
