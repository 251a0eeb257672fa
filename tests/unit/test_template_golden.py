"""Job script templates: golden files, jobscripts/ in sync, hostile values, and the CLI.

On a mismatch the diff is printed; regenerate after an intended change with
    UPDATE_GOLDEN=1 python -m pytest tests/unit/test_template_golden.py
and, for jobscripts/, `hpcckpt template NAME --out jobscripts/<file>`.
"""

from __future__ import annotations

import difflib
import math
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from hpcckpt.cluster import render
from hpcckpt.errors import ConfigError

REPO = Path(__file__).resolve().parents[2]
GOLDEN = Path(__file__).parent / "golden"
PARAMS = {
    "single": {"TIME": "1:00:00", "LEAD_S": "300", "RUN_DIR": "/scratch/my run", "JOB_NAME": "my job",
               "OUTPUT": "/scratch/my run/%x-%j.out", "COMMAND": 'python train.py --dir "$HPCCKPT_DIR"'},
    "ddp": {"NODES": "4", "TASKS_PER_NODE": "8", "SIGNAL": "USR2", "LEAD_S": "240",
            "COMMAND": "python -m mypkg.train --ckpt \"$HPCCKPT_DIR\""},
    "submitit": {"TIME_MIN": "120", "STEPS": "500"},
    "torchrun": {"NODES": "4", "PROCS_PER_NODE": "8", "LEAD_S": "240",
                 "COMMAND": "-m mypkg.train --ckpt \"$HPCCKPT_DIR\""},
    "lightning": {"NODES": "2", "TASKS_PER_NODE": "4", "TIME": "12:00:00", "RUN_DIR": "/scratch/my run",
                  "COMMAND": "python train.py --ckpt \"$HPCCKPT_DIR\""},
    "criu": {"TIME": "2:00:00", "LEAD_S": "600", "RUN_DIR": "/scratch/my run", "JOB_NAME": "criu job"},
    "own": {"TIME": "6:00:00", "LEAD_S": "300", "RUN_DIR": "/scratch/my run", "NOTICE": "USR1",
            "SAVES": "$HPCCKPT_RUN_DIR/checkpoint*.pth.tar",
            "COMMAND": 'python main.py --resume "$HPCCKPT_RUN_DIR/checkpoint.pth.tar" /data/imagenet'},
}


def _diff(expected: str, actual: str, name: str) -> str:
    return "".join(difflib.unified_diff(expected.splitlines(True), actual.splitlines(True),
                                        f"golden/{name}", "rendered"))


@pytest.mark.parametrize("name", sorted(render.TEMPLATES))
def test_rendered_template_matches_golden(name: str) -> None:
    actual = render.render(name, PARAMS[name])
    golden = GOLDEN / f"{name}.golden"
    if os.environ.get("UPDATE_GOLDEN") == "1":
        golden.write_text(actual)
    assert golden.exists(), f"missing {golden}; create it with UPDATE_GOLDEN=1"
    expected = golden.read_text()
    assert actual == expected, (f"template {name!r} changed:\n{_diff(expected, actual, golden.name)}\n"
                                "if intended: UPDATE_GOLDEN=1 python -m pytest "
                                "tests/unit/test_template_golden.py")


@pytest.mark.parametrize("name", sorted(render.TEMPLATES))
def test_jobscripts_are_the_rendered_defaults(name: str) -> None:
    tpl = render.TEMPLATES[name]
    shipped = (REPO / "jobscripts" / tpl.output_name).read_text()
    actual = render.render(name)
    assert shipped == actual, (f"jobscripts/{tpl.output_name} is stale:\n"
                               f"{_diff(shipped, actual, tpl.output_name)}\n"
                               f"regenerate: hpcckpt template {name} --out jobscripts/{tpl.output_name}")


def test_sbatch_templates_carry_requeue_signal_and_append() -> None:
    single = render.render("single")
    assert "#SBATCH --signal=B:USR2@180" in single and "trap warn USR2" in single and "trap 'termed=1; forward TERM' TERM" in single
    ddp = render.render("ddp")
    assert "#SBATCH --signal=USR2@180" in ddp and "HPCCKPT_REQUEUE_FROM_BATCH" not in ddp
    for text in (single, ddp):
        assert "#SBATCH --requeue" in text and "#SBATCH --open-mode=append" in text
        assert "USR1" in text  # the comment says why not USR1


def test_hostile_values_are_quoted_or_refused() -> None:
    text = render.render("single", {"JOB_NAME": "a b;c", "RUN_DIR": '/x/"y`z'})
    assert '#SBATCH --job-name="a b;c"' in text
    assert 'HPCCKPT_RUN_DIR="${HPCCKPT_RUN_DIR:-/x/\\"y\\`z}"' in text
    with pytest.raises(ConfigError, match="double quote"):
        render.render("single", {"OUTPUT": 'a"b'})
    with pytest.raises(ConfigError, match="one line"):
        render.render("single", {"TIME": "1\n#SBATCH --x"})
    with pytest.raises(ConfigError, match="no parameter"):
        render.render("single", {"NODES": "2"})
    with pytest.raises(ConfigError, match="available: criu, ddp, lightning, own, single, submitit, torchrun"):
        render.get("nope")


@pytest.mark.skipif(shutil.which("shellcheck") is None, reason="shellcheck not installed (slurm/install-deps)")
def test_rendered_scripts_are_shellcheck_clean(tmp_path: Path) -> None:
    for name in ("single", "ddp", "criu", "lightning", "torchrun", "own"):
        for params in ({}, PARAMS[name]):
            script = tmp_path / f"{name}.sbatch"
            script.write_text(render.render(name, params))
            proc = subprocess.run(["shellcheck", str(script)], capture_output=True, text=True, check=False)
            assert proc.returncode == 0, proc.stdout


def test_cli_lists_and_writes(tmp_path: Path) -> None:
    listed = subprocess.run([sys.executable, "-m", "hpcckpt.cli", "template", "--list", "--json"],
                            capture_output=True, text=True, check=True)
    assert {"single", "ddp", "submitit"} <= {row["name"] for row in __import__("json").loads(listed.stdout)}
    out = tmp_path / "job.sbatch"
    subprocess.run([sys.executable, "-m", "hpcckpt.cli", "template", "ddp", "--out", str(out),
                    "--set", "NODES=3"], check=True, capture_output=True)
    assert "#SBATCH --nodes=3" in out.read_text() and os.access(out, os.X_OK)
    bad = subprocess.run([sys.executable, "-m", "hpcckpt.cli", "template", "ddp", "--set", "X"],
                         capture_output=True, text=True, check=False)
    assert bad.returncode == 2 and "KEY=VALUE" in bad.stderr


def test_requeue_expedite_is_rendered_where_slurm_has_it(monkeypatch: pytest.MonkeyPatch,
                                                         capsys: pytest.CaptureFixture[str]) -> None:
    for name in ("single", "ddp", "lightning", "torchrun", "criu"):
        assert "#SBATCH --requeue\n" in render.render(name)
        assert "#SBATCH --requeue=expedite\n" in render.render(name, {"REQUEUE": "expedite"})
    with pytest.raises(ConfigError, match="REQUEUE='soon'.*plain.*expedite"):
        render.render("criu", {"REQUEUE": "soon"})
    from hpcckpt.cli.main import main
    from hpcckpt.cluster import scontrol

    # `hpcckpt template` asks the local Slurm (scontrol --version): the seam is that answer
    for version, line in (("25.11.0", "#SBATCH --requeue=expedite\n"), ("24.05.4", "#SBATCH --requeue\n"),
                          (None, "#SBATCH --requeue\n")):
        monkeypatch.setattr(scontrol, "slurm_version", lambda v=version: v)
        assert main(["template", "criu"]) == 0
        out, err = capsys.readouterr()
        assert line in out and ("expedite" in err) == (version == "25.11.0"), (version, err)
    monkeypatch.setattr(scontrol, "slurm_version", lambda: "25.11.0")
    assert main(["template", "criu", "--set", "REQUEUE=plain"]) == 0  # asked for: kept
    assert "#SBATCH --requeue\n" in capsys.readouterr().out


_STUB_HPCCKPT = """#!/bin/bash
# stands in for the hpcckpt CLI: records its arguments and whether TERM reached it ignored
ignored=$(( 0x$(awk '/^SigIgn:/ {print $2}' /proc/$$/status) >> 14 & 1 ))
echo "$* term_ignored=$ignored" >> "$STUB_LOG"
"""


@pytest.mark.parametrize(("command", "status", "called"), [
    # The command dies of a TERM this shell never got (Slurm signals a job's processes one at
    # a time): a stop all the same, decided by `hpcckpt requeue --stopped-status`.
    # --ran-s is the batch shell's $SECONDS: whole clock seconds, 0 or more (a second boundary
    # or a loaded machine): checked against the time the script took, not a fixed number.
    ("kill -TERM $$", 0, "requeue --dir {ck} --stopped-status 143 --ran-s {ran} term_ignored=1"),
    ("exit 75", 0, "requeue --dir {ck} term_ignored=1"),
    ("exit 3", 3, None),
])
def test_single_template_ending_decides_by_the_command_status(tmp_path: Path, command: str, status: int,
                                                              called: str | None) -> None:
    """The rendered single template's ending, under bash with a stub hpcckpt on PATH (no Slurm):
    which requeue it runs for each way the command ends, and that the requeue starts with TERM
    ignored (a TERM still on its way to the batch shell must not kill it)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    stub = bin_dir / "hpcckpt"
    stub.write_text(_STUB_HPCCKPT)
    stub.chmod(0o755)
    script = tmp_path / "single.sbatch"
    script.write_text(render.render("single", {"COMMAND": f"bash -c '{command}'", "RUN_DIR": str(tmp_path / "run")}))
    log = tmp_path / "stub.log"
    env = {"PATH": f"{bin_dir}:/usr/bin:/bin", "SLURM_JOB_ID": "77", "STUB_LOG": str(log), "HOME": str(tmp_path)}
    t0 = time.monotonic()
    out = subprocess.run(["bash", str(script)], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=60)
    took = time.monotonic() - t0
    assert out.returncode == status, out.stderr[-2000:]
    calls = log.read_text().splitlines() if log.exists() else []
    ran = re.search(r"--ran-s (\d+) ", calls[0]) if calls else None
    if ran is not None:
        assert int(ran.group(1)) <= math.ceil(took), (calls, took)
    want = [called.format(ck=tmp_path / "run" / "ckpt", ran=ran.group(1) if ran else "N")] if called else []
    assert calls == want, (calls, out.stdout, out.stderr)
