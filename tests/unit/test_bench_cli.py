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
    assert o.quick and o.size_bytes == 16_000_000 and len(o.sizes()) == 2 and o.overhead_steps >= 50
    check_room(o, tmp_path)  # 16 MB fits
    full = BenchOptions.make(size_gb=2.0, dir=tmp_path, quick=False, device="cuda")
    assert full.size_bytes == 2_000_000_000 and full.rounds == 3 and full.overhead_rounds == 1 and len(full.sizes()) == 3
    with pytest.raises(ConfigError, match="--size-gb"):
        BenchOptions.make(size_gb=float("nan"), dir=tmp_path, quick=False)
    with pytest.raises(ConfigError, match="free"):
        check_room(BenchOptions.make(size_gb=1e7, dir=tmp_path, quick=False), tmp_path)
