"""``hpcckpt bench --levels``: each checkpoint level's bandwidth and the every-step overhead at the
node-local level against the shared directory.

The real command through the CLI entry, tiny (--quick, 2 MB file set, 2 gloo ranks for the
partner copy): the JSON has every figure, each positive and finite where it is a rate or a
time, finite where it is an overhead (a difference of two timings may be below zero on a
busy machine), and the files are gone afterwards. Never a bound on a speed: speed targets
are timings, not tests. Also: the node-local directory is resolved as the levels resolve
it, the partner transfers pair up, the ratios, and bad option combinations.
"""
from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from hpcckpt.bench import levels
from hpcckpt.bench.levelproc import transfers
from hpcckpt.cli.main import main
from hpcckpt.store.scavenge import level_key
from tests.conftest import REPO

HANG_GUARD_S = 600  # a hang guard only: the run takes seconds


def _rate(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and v > 0


def _finite(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


@pytest.mark.native
@pytest.mark.slow
def test_levels_quick_json_has_every_level_and_both_every_step_arms(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("HPCCKPT_")}
    work, local = tmp_path / "work", tmp_path / "local"
    out = subprocess.run([sys.executable, "-m", "hpcckpt.cli", "bench", "--levels", "--quick", "--json",
                          "--device", "cpu", "--size-gb", "0.002", "--dir", str(work), "--local-dir", str(local)],
                         cwd=REPO, env=env, capture_output=True, text=True, timeout=HANG_GUARD_S, check=False)
    assert out.returncode == 0, out.stderr[-4000:]
    res = json.loads(out.stdout)  # stdout holds only the JSON; progress went to stderr
    assert "[levels" in out.stderr and "partner copy (2 gloo ranks)" in out.stderr
    assert res["kind"] == "levels" and res["files"] == levels.FILES == 2
    assert 1_900_000 <= res["set_bytes"] <= 2_000_000
    lv = res["levels"]
    assert set(lv) == {"node_local", "shared", "partner"}
    assert lv["node_local"]["dir"] == str(local)  # --local-dir is the node-local level's base
    assert lv["shared"]["dir"] == str(work)
    for level in ("node_local", "shared"):
        e = lv[level]
        for key in ("write_mbps", "read_mbps", "write_s", "read_s"):
            assert _rate(e[key]), (level, key, e[key])
        assert len(e["write_all_mbps"]) == len(e["read_all_mbps"]) == res["options"]["rounds"] == 1
        assert math.isclose(e["write_mbps"], res["set_bytes"] / e["write_s"] / 1e6)
    p = lv["partner"]
    assert p["ranks"] == 2 and "gloo" in p["transport"]
    for key in ("one_way_mbps", "both_ways_mbps", "one_way_s", "both_ways_s"):
        assert _rate(p[key]), (key, p[key])
    assert p["one_way_bytes"] == p["both_ways_bytes"] == res["set_bytes"]  # the whole set moves in both
    for key, v in res["vs_shared"].items():
        assert _rate(v), (key, v)
    ov = res["overhead"]
    assert ov["engine"] == "concurrent" and ov["every_steps"] == 1 and ov["rounds"] == 1
    assert levels.MIN_STEPS <= ov["steps"] <= levels.QUICK_STEPS and _rate(ov["step_s"]) and ov["state_bytes"] > 0
    for level in ("shared", "node_local"):
        e = ov[level]
        for key in ("overhead", "overhead_min", "per_save_ms"):
            assert _finite(e[key]), (level, key, e[key])
        for key in ("overhead_blocked", "blocked_per_save_ms"):
            assert _rate(e[key]), (level, key, e[key])  # a save every step blocks a little, never nothing
        assert len(e["run_s"]) == 1 and _rate(e["run_s"][0])
    assert _rate(ov["time_ratio"])
    ratio = ov["node_local_vs_shared"]
    assert (ratio is None) == (ov["shared"]["overhead"] <= 0)
    assert ratio is None or math.isclose(ratio, ov["node_local"]["overhead"] / ov["shared"]["overhead"])
    assert ov["node_local_within_shared"] == (ov["node_local"]["overhead"] <= ov["shared"]["overhead"])
    assert os.listdir(work) == []  # the file sets, checkpoints and ranks' logs are removed
    assert os.listdir(local) == []  # this run's node-local directory too (the base was given)
    shown = levels.text(res)
    assert "node_local" in shown and "partner" in shown and "node-local / shared overhead" in shown


def test_node_local_default_is_resolved_as_the_levels_resolve_it(tmp_path: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("SLURM_JOB_ID", raising=False)  # no prolog staging directory
    shared = tmp_path / "shared"
    monkeypatch.setenv("HPCCKPT_LOCAL_DIR", str(tmp_path / "env-local"))
    assert levels.node_local_root(shared, None) == tmp_path / "env-local" / level_key(shared)
    assert levels.node_local_root(shared, str(tmp_path / "opt")) == tmp_path / "opt" / level_key(shared)
    monkeypatch.delenv("HPCCKPT_LOCAL_DIR")
    assert levels.local_base(None) is None
    shm = Path("/dev/shm") / f"hpcckpt-{os.getuid()}"
    made = not shm.exists()
    got = levels.node_local_root(shared, None)
    try:
        assert got == shm / level_key(shared)
    finally:
        got.rmdir()
        if made:
            shm.rmdir()


def test_partner_transfers_pair_every_send_with_a_receive() -> None:
    files = [("/a/rank-0.bin", 10), ("/a/rank-1.bin", 20)]
    into = ["/in0", "/in1"]
    for kind in ("one_way", "both_ways"):
        s0, r0 = transfers(kind, 0, files, into)
        s1, r1 = transfers(kind, 1, files, into)
        # what rank 0 sends to 1, rank 1 receives from 0, in the same order and sizes (and back)
        assert [(n,) for d, _, n in s0 if d == 1] == [(n,) for src, _, n in r1 if src == 0]
        assert [(n,) for d, _, n in s1 if d == 0] == [(n,) for src, _, n in r0 if src == 1]
        assert sum(n for _, _, n in s0 + s1) == 30  # the whole set moves, either way
        assert all(p.startswith("/in1/") for _, p, _ in r1) and all(p.startswith("/in0/") for _, p, _ in r0)
    assert transfers("one_way", 1, files, into)[0] == []
    with pytest.raises(ValueError):
        transfers("sideways", 0, files, into)


def test_file_sizes_are_whole_pages() -> None:
    assert levels.file_sizes(10 << 20) == [5 << 20, 5 << 20]
    assert all(n % 4096 == 0 and n >= 4096 for n in levels.file_sizes(1000))


def _over(shared: float, local: float) -> dict[str, Any]:
    runs = {"concurrent": {"1": [1.0 + shared]}, "concurrent_local": {"1": [1.0 + local]}}
    return {"overhead": {"concurrent": {"1": shared}, "concurrent_local": {"1": local}},
            "overhead_min": {"concurrent": {"1": shared}, "concurrent_local": {"1": local}},
            "overhead_blocked": {"concurrent": {"1": 0.1}, "concurrent_local": {"1": 0.05}},
            "overhead_detail": {"baseline_runs_s": [1.0], "run_s": runs,
                                "blocked_s": {k: {"1": [0.1]} for k in runs}, "drain_s": {k: {"1": [0.0]} for k in runs},
                                "rounds": 1, "steps": 10, "steps_by_interval": {"1": 10}, "step_s": 0.1,
                                "state_bytes": 1, "model": {}}}


def test_overhead_ratio_and_its_undefined_case() -> None:
    got = levels._overhead(_over(0.5, 0.25))
    assert math.isclose(got["node_local_vs_shared"], 0.5) and got["node_local_within_shared"]
    assert math.isclose(got["time_ratio"], 1.25 / 1.5)
    assert math.isclose(got["shared"]["per_save_ms"], 50.0)
    noise = levels._overhead(_over(-0.01, 0.02))  # the shared arm within noise of the baseline: no ratio
    assert noise["node_local_vs_shared"] is None and not noise["node_local_within_shared"]


@pytest.mark.parametrize("args,words", [
    (["--local-dir", "/dev/shm"], ["--local-dir", "--levels"]),
    (["--levels", "--peers"], ["--peers and --levels", "one of them"]),
    (["--levels", "--ranks", "2"], ["--ranks and --levels", "one of them"]),
    (["--levels", "--device", "cpu", "--plot", "l.png"], ["--plot", "--levels"]),
    (["--levels", "--device", "cpu", "--local-dir", " "], ["--local-dir", "e.g. --local-dir"]),
])
def test_bad_levels_options_are_clear_usage_errors(args: list[str], words: list[str], tmp_path: Path,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["bench", *args, "--dir", str(tmp_path / "work")])
    err = capsys.readouterr().err
    assert code == 2 and "Traceback" not in err, err
    for word in words:
        assert word in err, (word, err)
