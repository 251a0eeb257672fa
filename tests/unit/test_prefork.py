"""tests/prefork.py: a forked child behaves as ``python SCRIPT``/``python -m MODULE`` would
(arguments, working directory, environment, output, exit code, signals, exit steps), and
starts with torch already imported."""
from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.prefork import Child, wait_all

SCRIPT = """
import atexit, json, os, sys, threading, time
preloaded = "torch" in sys.modules
how = sys.argv[1]
atexit.register(lambda: print("atexit ran", flush=True))
def late():
    time.sleep(0.2)
    print("thread joined", flush=True)
if how == "ok":
    print(json.dumps({"argv": sys.argv[1:], "cwd": os.getcwd(), "env": os.environ.get("PREFORK_PROBE"),
                      "preloaded": preloaded, "name": __name__}))
    threading.Thread(target=late).start()
elif how == "exit":
    sys.exit(int(sys.argv[2]))
elif how == "raise":
    raise RuntimeError("boom from the child")
elif how == "hang":
    print("ready", flush=True)
    time.sleep(600)
"""


@pytest.fixture()
def script(tmp_path: Path) -> Path:
    path = tmp_path / "probe.py"
    path.write_text(SCRIPT)
    return path


def test_the_child_gets_its_arguments_directory_environment_and_runs_the_exit_steps(
        script: Path, tmp_path: Path) -> None:
    work = tmp_path / "work"
    work.mkdir()
    out = tmp_path / "out.txt"
    child = Child([sys.executable, str(script), "ok", "x y"], cwd=work, output=out,
                  env={"PREFORK_PROBE": "seen", "PATH": "/usr/bin:/bin"})
    assert child.communicate(120) == out.read_text()
    assert child.returncode == 0
    lines = out.read_text().splitlines()
    import json
    got = json.loads(lines[0])
    assert got == {"argv": ["ok", "x y"], "cwd": str(work), "env": "seen", "preloaded": True, "name": "__main__"}
    assert lines[1:] == ["thread joined", "atexit ran"], lines  # threads joined, then atexit, as at interpreter exit


@pytest.mark.parametrize(("args", "code", "says"), [(["exit", "3"], 3, ""), (["raise"], 1, "boom from the child")])
def test_exit_codes_and_uncaught_errors_are_those_of_python(script: Path, tmp_path: Path, args: list[str],
                                                            code: int, says: str) -> None:
    child = Child([str(script), *args], output=tmp_path / "out.txt")
    text = child.communicate(120)
    assert child.returncode == code, text
    assert says in text and ("Traceback" in text) == bool(says), text


def test_a_module_runs_with_dash_m(tmp_path: Path) -> None:
    pkg = tmp_path / "probe_pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "main.py").write_text("import sys\nprint(__name__, sys.argv[1:])\nsys.exit(7)\n")
    child = Child(["-m", "probe_pkg.main", "a"], cwd=tmp_path, output=tmp_path / "out.txt")
    assert child.wait(120) == 7
    assert child.read_output().strip() == "__main__ ['a']"


def test_a_child_is_a_real_process_that_signals_reach(script: Path, tmp_path: Path) -> None:
    out = tmp_path / "out.txt"
    children = [Child([str(script), "hang"], output=out) for _ in range(2)]
    deadline = time.monotonic() + 120
    while out.read_text().count("ready") < 2 if out.exists() else True:
        assert time.monotonic() < deadline, "children never started"
        time.sleep(0.05)
    assert len({c.pid for c in children}) == 2
    children[0].kill()
    children[1].send_signal(signal.SIGTERM)
    assert [c.wait(60) for c in children] == [-signal.SIGKILL, -signal.SIGTERM]
    children[1].kill()  # already ended: nothing is signalled


def test_wait_all_kills_what_overruns(script: Path, tmp_path: Path) -> None:
    child = Child([str(script), "hang"], output=tmp_path / "out.txt")
    with pytest.raises(subprocess.TimeoutExpired):
        wait_all([child], 0.5)
    assert child.returncode == -signal.SIGKILL
    # kill_late: the survivors of a world are killed and their codes returned, no exception
    late = Child([str(script), "hang"], output=tmp_path / "late.txt")
    assert wait_all([late], 0.5, kill_late=True) == [-signal.SIGKILL]


def test_run_keeps_stdout_and_stderr_apart(tmp_path: Path) -> None:
    from tests.prefork import run
    script = tmp_path / "two.py"
    script.write_text("import sys\nprint('to out')\nprint('to err', file=sys.stderr)\nsys.exit(2)\n")
    done = run([sys.executable, str(script)], timeout=120)
    assert (done.returncode, done.stdout, done.stderr) == (2, "to out\n", "to err\n")


def test_dash_c_runs_code_with_its_arguments(tmp_path: Path) -> None:
    from tests.prefork import run
    done = run([sys.executable, "-c", "import sys, os; print(__name__, sys.argv, os.getcwd()); sys.exit(4)", "a1"],
               cwd=tmp_path, timeout=120)
    assert (done.returncode, done.stdout) == (4, f"__main__ ['-c', 'a1'] {tmp_path}\n"), done
