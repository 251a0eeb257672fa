"""Options of ``hpcckpt bench`` and ``hpcckpt demo``: bad values are clear errors (exit 2), never tracebacks.

Table-driven and in-process (the real parser and the real checks, nothing runs).
Also: ``--device`` resolution, the work directory, and children that do not import
a source tree from their working directory.
"""
from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from hpcckpt.bench import BenchOptions, check_room
from hpcckpt.cli.main import main
from hpcckpt.demo.run import DemoOptions, pick_preempt_steps, train_cmd
from hpcckpt.demo.runtime import CUBLAS_WORKSPACE, child_env, module_cmd, resolve_device, work_dir
from hpcckpt.errors import ConfigError

# (argv after the verb, words the error must contain)
BENCH_BAD = [
    (["--size-gb", "nan"], ["--size-gb", "e.g. --size-gb 2"]),
    (["--size-gb", "inf"], ["--size-gb", "e.g. --size-gb 2"]),
    (["--size-gb", "0"], ["--size-gb", "above zero"]),
    (["--size-gb", "-1"], ["--size-gb", "above zero"]),
    (["--size-gb", "abc"], ["--size-gb", "not a number"]),
    (["--size-gb", "1e6"], ["--size-gb", "free", "e.g. --size-gb"]),
    (["--size-gb", "0.0000001"], ["--size-gb", "1 MiB"]),
    (["--device", "tpu"], ["--device", "auto, cuda, cpu"]),
    (["--device", "cuda"], ["--device cuda", "--device cpu"]),
    (["--device", "cpu", "--plot", "/nonexistent-dir/bench.png"], ["--plot", "e.g. --plot bench.png"]),
    (["--device", "cpu", "--plot", "/"], ["--plot /"]),
    (["--peers", "--tensors", "64"], ["--peers and --tensors", "one of them"]),
    (["--peers", "--ranks", "2"], ["--ranks and --peers", "one of them"]),
    (["--tensors", "3"], ["--tensors 3", "from 4", "e.g. --tensors 64,1024,8192"]),
    (["--tensors", "64,x"], ["--tensors 64,x", "'x'", "e.g. --tensors"]),
    (["--tensors", "1000000", "--size-gb", "0.001", "--device", "cpu"], ["--tensors 1000000", "--size-gb"]),
    (["--tensors", "64", "--device", "cpu", "--plot", "t.png"], ["--plot", "--tensors"]),
    (["--peers", "--size-gb", "1e6", "--device", "cpu"], ["--size-gb", "--peers", "free"]),
    (["--small-state", "1,x"], ["--small-state '1,x'", "e.g. --small-state 1.4,19"]),
    (["--small-state", "3"], ["--small-state '3'", "MB", "ms"]),
    (["--small-state", "nan,6"], ["--small-state 'nan,6'", "0.01-1000 MB"]),
    (["--small-state", "3,0"], ["--small-state '3,0'", "0.1-10000 ms"]),
    (["--small-state", "--peers"], ["--peers and --small-state", "one of them"]),
    (["--small-state", "--size-gb", "1"], ["--size-gb 1", "--small-state MB,MS"]),
    (["--small-state", "--plot", "s.png"], ["--plot", "--small-state"]),
]
DEMO_BAD = [
    (["--every", "0"], ["--every 0", "e.g. --every 10"]),
    (["--every", "-3"], ["--every -3"]),
    (["--preemptions", "-1"], ["--preemptions -1", "e.g. --preemptions 1"]),
    (["--preemptions", "0"], ["--preemptions 0"]),
    (["--preempt-at", "abc"], ["--preempt-at", "'abc'", "e.g. --preempt-at 9,23"]),
    (["--preempt-at", "5,x"], ["--preempt-at", "'x'"]),
    (["--steps", "30", "--preempt-at", "30"], ["--preempt-at 30", "1..29"]),
    (["--steps", "30", "--preempt-at", "0"], ["--preempt-at 0"]),
    (["--steps", "0"], ["--steps 0", "e.g. --steps 60"]),
    (["--steps", "-5"], ["--steps -5"]),
    (["--steps", "5"], ["--steps of at least 6", "--preempt-at"]),
    (["--steps", "20", "--preemptions", "30"], ["--preemptions 30", "--steps of at least 35"]),
    (["--device", "gpu"], ["--device", "auto, cuda, cpu"]),
    (["--device", "cuda"], ["--device cuda", "--device cpu"]),
    (["--engine", "fast"], ["--engine", "sync", "concurrent"]),
]


def cuda() -> bool:
    import torch
    return bool(torch.cuda.is_available())


def run_cli(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str]:
    try:
        code = main(argv)
    except SystemExit as exc:  # argparse's own usage errors
        code = int(exc.code or 0)
    err = capsys.readouterr().err
    return code, err


@pytest.mark.parametrize("verb,args,words", [("bench", a, w) for a, w in BENCH_BAD]
                         + [("demo", a, w) for a, w in DEMO_BAD])
def test_bad_option_is_a_clear_usage_error(verb: str, args: list[str], words: list[str], tmp_path: Path,
                                           capsys: pytest.CaptureFixture[str]) -> None:
    if "cuda" in args and cuda():
        pytest.skip("a GPU is visible: --device cuda is valid here")
    code, err = run_cli([verb, *args, "--dir", str(tmp_path / "work")], capsys)
    assert code == 2, err
    assert "Traceback" not in err
    for word in words:
        assert word in err, (word, err)


@pytest.mark.parametrize("verb", ["bench", "demo"])
def test_a_file_as_dir_is_refused(verb: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    f = tmp_path / "a-file"
    f.write_text("x")
    code, err = run_cli([verb, "--device", "cpu", "--dir", str(f)], capsys)
    assert code == 2 and "is a file, not a directory" in err and str(f) in err, err
    assert f.read_text() == "x"


@pytest.mark.parametrize("verb", ["bench", "demo"])
def test_a_dir_that_cannot_be_created_is_refused(verb: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("x")
    code, err = run_cli([verb, "--device", "cpu", "--dir", str(blocker / "sub")], capsys)
    assert code == 2 and "cannot create the directory" in err, err


def test_json_errors_stay_json(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    import json
    code = main(["demo", "--steps", "0", "--json", "--dir", str(tmp_path)])
    out = json.loads(capsys.readouterr().out)
    assert code == 2 and out["type"] == "ConfigError" and "--steps 0" in out["error"]


def test_resolve_device() -> None:
    assert resolve_device("cpu") == "cpu"
    assert resolve_device(" CPU ") == "cpu"
    assert resolve_device("auto") == ("cuda" if cuda() else "cpu")
    with pytest.raises(ConfigError, match="not a device"):
        resolve_device("mps")


def test_work_dir_creates_parents(tmp_path: Path) -> None:
    d = work_dir(tmp_path / "a" / "b" / "c")
    assert d.is_dir()
    assert work_dir(d) == d  # an existing directory is fine


def test_child_env_is_deterministic_on_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)
    assert child_env("cuda")["CUBLAS_WORKSPACE_CONFIG"] == CUBLAS_WORKSPACE
    assert "CUBLAS_WORKSPACE_CONFIG" not in child_env("cpu")
    monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", ":16:8")  # the user's own choice is kept
    assert child_env("cuda")["CUBLAS_WORKSPACE_CONFIG"] == ":16:8"


def test_children_do_not_import_a_source_tree_from_their_cwd(tmp_path: Path) -> None:
    """A source checkout in the working directory (here a fake ``hpcckpt`` that refuses to
    import) is not what the demo's and bench's children import."""
    fake = tmp_path / "hpcckpt"
    (fake / "demo").mkdir(parents=True)
    (fake / "__init__.py").write_text("raise SystemExit('imported the source tree in the working directory')\n")
    (fake / "demo" / "__init__.py").write_text("")
    (fake / "demo" / "runtime.py").write_text("")
    out = subprocess.run(module_cmd("hpcckpt.demo.runtime"), cwd=tmp_path, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0 and "source tree" not in out.stderr, out.stderr
    cmd = train_cmd(tmp_path / "run", DemoOptions(steps=30))
    assert cmd[:len(module_cmd("hpcckpt.demo.train"))] == module_cmd("hpcckpt.demo.train")
    assert cmd[cmd.index("--device") + 1] == "cpu"


def test_demo_options_table() -> None:
    o = DemoOptions(steps=30, preempt_at=(23, 9, 9))
    assert pick_preempt_steps(o) == [9, 23]
    r = DemoOptions(steps=60, preemptions=3, seed=5)
    steps = pick_preempt_steps(r)
    assert len(steps) == 3 and all(2 <= s < 57 for s in steps)
    with pytest.raises(ConfigError):
        DemoOptions(steps=60, device="tpu")


def test_bench_options_quick_and_room(tmp_path: Path) -> None:
    o = BenchOptions.make(size_gb=None, dir=tmp_path, quick=True, device="cpu")
    assert o.quick and o.size_bytes == 16_000_000 and len(o.sizes()) == 1 and o.overhead_steps >= 50
    check_room(o, tmp_path)  # 16 MB fits
    full = BenchOptions.make(size_gb=2.0, dir=tmp_path, quick=False, device="cuda")
    assert full.size_bytes == 2_000_000_000 and full.rounds == 3 and full.overhead_rounds == 1 and len(full.sizes()) == 3
    with pytest.raises(ConfigError, match="--size-gb"):
        BenchOptions.make(size_gb=float("nan"), dir=tmp_path, quick=False)
    with pytest.raises(ConfigError, match="free"):
        check_room(BenchOptions.make(size_gb=1e7, dir=tmp_path, quick=False), tmp_path)


def _engine_figures(stall: float, persist: float, load: float, raw: float) -> dict[str, object]:
    return {"stall_s": stall, "first_stall_s": 2 * stall, "first_vs_steady": 2.0, "persist_s": persist,
            "persist_gbps": 1.0 / persist, "persist_vs_raw_write": 0.9, "load_s": load, "load_gbps": 1.0 / load,
            "load_all_s": [load], "raw_read_all_s": [raw], "raw_read_gbps": 1.0 / raw, "load_vs_raw_read": raw / load,
            "load_fresh_vs_raw_read": 0.5, "raw_read_fresh_vs_raw_read": 0.4, "load_fresh_vs_raw_read_fresh": 1.2,
            "snapshot_gbps": 40.0}


@pytest.mark.parametrize("device,copy_key,stall_target,torch_target", [("cuda", "pinned_d2h_gbps", 0.02, 2.0),
                                                                       ("cpu", "memcpy_gbps", 0.1, 3.0)])
def test_targets_use_the_device_bar(device: str, copy_key: str, stall_target: float, torch_target: float) -> None:
    """The ratios the GPU acceptance reads, from hand-made figures (the arithmetic, not the measuring)."""
    from hpcckpt.bench import _targets
    from hpcckpt.cli.bench import text

    sync = {**_engine_figures(2.0, 2.0, 2.0, 1.0), "torch_load_all_s": [4.0], "torch_load_s": 4.0}
    conc = _engine_figures(0.02, 1.0, 1.0, 0.9)
    limits = {"write_gbps": 1.0, "write_dd_gbps": 0.5, "read_gbps": 1.0, "memcpy_gbps": 50.0,
              "fresh_memory_gbps": 4.0, "pinned_d2h_gbps": 50.0, "pinned_h2d_gbps": 50.0}
    over = {"overhead": {"sync": {"1": 1.0, "10": 0.2, "50": 0.05}, "concurrent": {"1": 0.3, "10": 0.02, "50": 0.0}},
            "overhead_blocked": {"sync": {"10": 0.2}, "concurrent": {"10": 0.001}},
            "overhead_detail": {"state_bytes": 1_200_000_000, "step_s": 0.1}}
    top = {"state_bytes": 2_000_000_000, "sync": sync, "concurrent": conc}
    t = _targets(top, limits, over, device)
    assert t["device"] == device and t["snapshot_copy_limit"] == copy_key
    assert t["stall_vs_sync"] == pytest.approx(0.01) and t["stall_vs_sync_target"] == stall_target
    assert t["snapshot_vs_copy_limit"] == pytest.approx(0.8)
    assert t["load_vs_torch_load"] == pytest.approx(4.0) and t["load_vs_torch_load_target"] == torch_target
    assert t["load_vs_torch_load_ceiling"] == pytest.approx(4.0 / 0.9)
    # 1.2 GB at 1 GB/s takes 1.2 s: not within 1 step (0.1 s) or 10 (1.0 s), within 50 (5 s)
    assert t["disk_absorbs"] == {"1": False, "10": False, "50": True}
    res = {"device": device, "state_bytes": top["state_bytes"], "limits": limits, "targets": t,
           "engines": {"sync": sync, "concurrent": conc}, "overhead": over["overhead"],
           "staging": {"supported": True, "fractions": {"1.0": {"stall_s": 0.01}, "0.25": {"stall_s": 0.03}}}}
    shown = text(res)
    assert ("pinned D2H 50.0 GB/s" in shown) == (device == "cuda")
    assert "25% 0.0300s" in shown and "@10 no" in shown
