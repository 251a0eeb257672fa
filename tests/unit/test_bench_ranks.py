"""``hpcckpt bench --ranks N``: bytes written per rank and per checkpoint on 1 and N local ranks.

The real command through the CLI entry (2 gloo ranks, --quick), asserting what must
hold whatever the machine's speed: replicated state written once (bytes per
checkpoint = state bytes at 2 ranks, for both engines), each rank a near-equal share,
1 rank writing the whole state. The JIT overhead part: its figures exist, are finite,
and come from the rounds asked for, with the arms alternating (never a bound on the
overhead itself: that is a timing). Also: bad --ranks values, and that a failing or
interrupted rank set is reported and reaped.
"""
from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from hpcckpt.bench import ranks
from hpcckpt.cli.main import main
from hpcckpt.errors import HpcckptError
from tests.conftest import REPO

HANG_GUARD_S = 600  # a hang guard only: the run takes seconds


def close(a: float, b: float, rel: float = 0.01) -> bool:
    return abs(a - b) <= rel * abs(b)


@pytest.mark.native
@pytest.mark.slow
def test_ranks_2_quick_json_reports_bytes_written_once_and_persist_against_1_rank(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("HPCCKPT_")}
    work = tmp_path / "work"
    out = subprocess.run([sys.executable, "-m", "hpcckpt.cli", "bench", "--ranks", "2", "--quick", "--json",
                          "--dir", str(work)], cwd=REPO, env=env, capture_output=True, text=True,
                         timeout=HANG_GUARD_S, check=False)
    assert out.returncode == 0, out.stderr[-4000:]
    res = json.loads(out.stdout)  # stdout holds only the JSON; progress went to stderr
    assert "[bench --ranks" in out.stderr
    assert res["ranks"] == 2
    state = res["state_bytes"]
    assert state >= 15_000_000  # --quick: 16 MB of parameters + Adam moments
    assert set(res["engines"]) == {"sync", "concurrent"}
    for name, row in res["engines"].items():
        assert set(row) >= {"1", "2", "bytes_vs_state", "persist_vs_1_rank"}, (name, row)
        one, two = row["1"], row["2"]
        for world, e in ((1, one), (2, two)):
            assert set(e) >= {"persist_s", "bytes_per_checkpoint", "bytes_per_rank", "share_per_rank",
                              "state_bytes"}, (name, world, e)
            assert e["format"] == "hpcckpt/4" and e["world_size"] == world
            assert len(e["bytes_per_rank"]) == len(e["share_per_rank"]) == world
            assert sum(e["bytes_per_rank"]) == e["bytes_per_checkpoint"]
            assert e["persist_s"] > 0
            assert close(e["state_bytes"], state)
            for b, s in zip(e["bytes_per_rank"], e["share_per_rank"]):
                assert close(s, b / e["state_bytes"], 1e-9)
        # 1 rank writes the whole state, once
        assert close(one["bytes_per_checkpoint"], state), (name, one)
        # 2 ranks: the replicated state is written once (not 2x), half by each rank
        assert close(row["bytes_vs_state"], 1.0), (name, row["bytes_vs_state"])
        assert close(two["bytes_per_checkpoint"], two["state_bytes"])
        for share in two["share_per_rank"]:
            assert close(share, 0.5, 0.02), (name, two["share_per_rank"])
        assert close(row["persist_vs_1_rank"], two["persist_s"] / one["persist_s"], 1e-9)
    jit = res["jit"]
    assert jit["world"] == 2 and jit["rounds"] == ranks.QUICK_JIT_ROUNDS == len(jit["per_round"])
    assert jit["steps"] == ranks.QUICK_JIT_STEPS and math.isfinite(jit["overhead"])
    assert res["options"]["jit_rounds"] == ranks.QUICK_JIT_ROUNDS
    assert "jit=False against jit=True on 2 ranks" in out.stderr
    assert os.listdir(work) == []  # the checkpoints and the ranks' logs are removed


def _finite(v: object) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


@pytest.mark.native
@pytest.mark.slow
def test_jit_overhead_pairs_off_and_on_arms_over_the_rounds_asked_for(tmp_path: Path,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HPCCKPT_JIT", "0")  # the bench sets jit per arm whatever the environment says
    o = ranks.RanksOptions(ranks=2, size_bytes=1, dir=tmp_path, jit_rounds=3, jit_steps=4, jit_warmup=1)
    j = ranks.run_jit(o, tmp_path)
    assert (j["world"], j["steps"], j["rounds"], j["warmup"]) == (2, 4, 3, 1)
    assert j["engine"] == "concurrent" and j["every_steps"] is None
    for key in ("step_s_off", "step_s_on", "overhead", "overhead_min", "overhead_max", "cpu_overhead",
                "boundary_s", "boundary_vs_step", "guard_cpu_s_per_step", "guard_cpu_share"):
        assert _finite(j[key]), (key, j[key])
    assert j["step_s_off"] > 0 and j["step_s_on"] > 0
    assert j["boundary_s"] > 0  # the guard ran: its boundary work was timed at every step
    assert j["overhead_min"] <= j["overhead"] <= j["overhead_max"]
    rounds = j["per_round"]
    assert [r["round"] for r in rounds] == [0, 1, 2]
    assert [r["first"] for r in rounds] == ["off", "on", "off"]  # the arm that runs first alternates
    for r in rounds:
        assert r["off_s"] > 0 and r["on_s"] > 0
        assert math.isclose(r["overhead"], (r["on_s"] - r["off_s"]) / r["off_s"])
        assert r["guard_cpu_share"] is None or 0 <= r["guard_cpu_share"] < 1
    assert os.listdir(tmp_path) == []  # the ranks' directories and logs are removed
    res = {"ranks": 2, "state_bytes": 1, "options": {"rounds": 1}, "engines": {}, "jit": j}
    shown = ranks.text(res)
    assert "2 ranks" in shown and "3 paired rounds of 4 timed steps" in shown and "1 warm-up" in shown
    assert f"{100 * j['overhead']:+.2f}%" in shown


@pytest.mark.parametrize("args", [
    ["--jit-steps", "5", "--world", "1"],
    ["--jit-steps", "-1", "--world", "2"],
    ["--world", "2"],  # neither a state size nor --jit-steps
])
def test_rankproc_refuses_a_jit_run_it_cannot_do(args: list[str], tmp_path: Path,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    from hpcckpt.bench import rankproc
    with pytest.raises(SystemExit) as info:
        rankproc.parse(["--rank", "0", "--port", "1", "--dir", str(tmp_path), "--rounds", "1",
                        "--out", str(tmp_path / "r.json"), *args])
    assert info.value.code == 2
    assert "--" in capsys.readouterr().err


def run_cli(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str]:
    try:
        code = main(argv)
    except SystemExit as exc:  # argparse's own usage errors
        code = int(exc.code or 0)
    return code, capsys.readouterr().err


@pytest.mark.parametrize("args,words", [
    (["--ranks", "1"], ["--ranks", "2 or more", "e.g. --ranks 4"]),
    (["--ranks", "0"], ["--ranks", "2 or more"]),
    (["--ranks", "-3"], ["--ranks", "2 or more"]),
    (["--ranks", "abc"], ["--ranks", "not a whole number", "e.g. --ranks 4"]),
    (["--ranks", "2.5"], ["--ranks", "not a whole number"]),
    (["--ranks", "2", "--size-gb", "1e6"], ["--size-gb", "free", "e.g. --size-gb"]),
    (["--ranks", "100000", "--size-gb", "0.5"], ["--ranks 100000", "fewer --ranks", "e.g. --size-gb"]),
    (["--ranks", "2", "--plot", "x.png"], ["--plot", "--ranks"]),
    (["--ranks", "2", "--device", "tpu"], ["--device", "auto, cuda, cpu"]),
])
def test_bad_ranks_options_are_clear_usage_errors(args: list[str], words: list[str], tmp_path: Path,
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    code, err = run_cli(["bench", *args, "--dir", str(tmp_path / "work")], capsys)
    assert code == 2, err
    assert "Traceback" not in err
    for word in words:
        assert word in err, (word, err)
    assert not (tmp_path / "work").exists() or os.listdir(tmp_path / "work") == []  # nothing started


def test_rank_env_drops_slurm_and_runs_one_thread(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SLURM_JOB_ID", "123")
    monkeypatch.setenv("SLURM_PROCID", "3")
    env = ranks.rank_env()
    assert not any(k.startswith("SLURM_") for k in env)
    assert env["OMP_NUM_THREADS"] == "1" and env["HPCCKPT_CLUSTER"] == "local"


def _ranks_where_one_fails(tmp_path: Path) -> tuple[list[list[str]], list[Path], Path]:
    """Rank 0 writes its pid and would sleep for 10 minutes; rank 1 waits for that pid, prints, exits 3."""
    pid = tmp_path / "pid0"
    sleeper = f"import os, time; open({str(pid)!r} + '.tmp', 'w').write(str(os.getpid())); " \
              f"os.replace({str(pid)!r} + '.tmp', {str(pid)!r}); time.sleep(600)"
    failer = textwrap.dedent(f"""
        import os, sys, time
        while not os.path.exists({str(pid)!r}):
            time.sleep(0.01)
        print('setting up')
        print('boom: rank one cannot go on', file=sys.stderr)
        sys.exit(3)
    """)
    logs = [tmp_path / "log-r0.txt", tmp_path / "log-r1.txt"]
    return [[sys.executable, "-c", sleeper], [sys.executable, "-c", failer]], logs, pid


def _gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


def test_a_failing_rank_is_one_clear_error_and_every_rank_is_reaped(tmp_path: Path) -> None:
    cmds, logs, pid_file = _ranks_where_one_fails(tmp_path)
    with pytest.raises(HpcckptError) as info:
        ranks.run_procs(cmds, logs, what="sync engine on 2 ranks", timeout_s=HANG_GUARD_S)
    msg = str(info.value)
    head = msg.splitlines()[0]
    assert "rank 1 of 2" in head and "code 3" in head and "sync engine on 2 ranks" in head, msg
    assert "boom: rank one cannot go on" in msg and "Traceback" not in msg
    assert _gone(int(pid_file.read_text()))  # the sleeping rank was ended and reaped


def test_an_interrupt_reaps_every_rank(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    cmds, logs, pid_file = _ranks_where_one_fails(tmp_path)
    pid1 = tmp_path / "pid1"
    cmds[1] = [sys.executable, "-c", f"import os, time; open({str(pid1)!r} + '.tmp', 'w').write(str(os.getpid())); "
               f"os.replace({str(pid1)!r} + '.tmp', {str(pid1)!r}); time.sleep(600)"]
    real_sleep = ranks.time.sleep

    def sleep(s: float) -> None:
        if pid_file.exists() and pid1.exists():
            raise KeyboardInterrupt  # Ctrl-C while the ranks run
        real_sleep(s)

    monkeypatch.setattr(ranks.time, "sleep", sleep)
    with pytest.raises(KeyboardInterrupt):
        ranks.run_procs(cmds, logs, what="t", timeout_s=HANG_GUARD_S)
    assert _gone(int(pid_file.read_text())) and _gone(int(pid1.read_text()))
