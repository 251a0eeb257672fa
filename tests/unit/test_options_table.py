"""Bad options and environment variables, table-driven: each row is an input, and each
must give a non-zero exit (or a ConfigError), a message naming the option, and never a
traceback. The rows are the campaign's cases plus their neighbours."""

from __future__ import annotations

import logging
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from hpcckpt.cli.main import main
from hpcckpt.config import from_env, resolve_options
from hpcckpt.doctor import SignalSpec
from hpcckpt.errors import ConfigError

REPO = Path(__file__).resolve().parents[2]

BAD_ENV = [
    ("HPCCKPT_SIGNALS", "SIGKILL"), ("HPCCKPT_SIGNALS", "STOP"), ("HPCCKPT_SIGNALS", "SIGSEGV"),
    ("HPCCKPT_SIGNALS", "SIGCHLD"), ("HPCCKPT_SIGNALS", ","), ("HPCCKPT_SIGNALS", "USR9"),
    ("HPCCKPT_SIGNALS", "99"), ("HPCCKPT_SIGNALS", "USR2,KILL"),
    ("HPCCKPT_DEADLINE_MARGIN_S", "nan"), ("HPCCKPT_DEADLINE_MARGIN_S", "-1"),
    ("HPCCKPT_DEADLINE_MARGIN_S", "inf"), ("HPCCKPT_DEADLINE_MARGIN_S", "soon"),
    ("HPCCKPT_WRITER_THREADS", "-4"), ("HPCCKPT_WRITER_THREADS", "2.5"), ("HPCCKPT_WRITER_THREADS", "100000"),
    ("HPCCKPT_KEEP", "0"), ("HPCCKPT_KEEP", "-1"), ("HPCCKPT_KEEP", "all"),
    ("HPCCKPT_MAX_ASYNC", "0"), ("HPCCKPT_OVERHEAD_BOUND", "0"), ("HPCCKPT_OVERHEAD_BOUND", "1.5"),
    ("HPCCKPT_OVERHEAD_BOUND", "nan"), ("HPCCKPT_EVERY_STEPS", "0"), ("HPCCKPT_EVERY_STEPS", "-3"),
    ("HPCCKPT_EVERY_STEPS", "often"), ("HPCCKPT_ENGINE", "fast"), ("HPCCKPT_ON_BUSY", "later"),
    ("HPCCKPT_MEMORY_BUDGET_BYTES", "0"), ("HPCCKPT_MEMORY_BUDGET_BYTES", "-1G"),
    ("HPCCKPT_MEMORY_BUDGET_BYTES", "lots"), ("HPCCKPT_DIRECT", "maybe"),
]


@pytest.mark.parametrize(("var", "value"), BAD_ENV)
def test_bad_environment_is_refused_by_name_before_anything_runs(
        var: str, value: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from hpcckpt import Checkpointer

    monkeypatch.setenv(var, value)
    with pytest.raises(ConfigError) as err:
        Checkpointer(tmp_path / "ckpt")
    assert var in str(err.value) and "e.g." in str(err.value), err.value
    assert not (tmp_path / "ckpt").exists(), "nothing may be created before the options are valid"


BAD_ARGS = [
    {"writer_threads": -4}, {"writer_threads": True}, {"deadline_margin_s": float("nan")},
    {"deadline_margin_s": -5.0}, {"keep": 0}, {"max_async": 0}, {"overhead_bound": 2.0},
    {"every_steps": 0}, {"every_steps": 2.5}, {"signals": ()}, {"signals": ("SIGKILL",)},
    {"signals": ("SIGSEGV", "SIGTERM")}, {"memory_budget_bytes": -1}, {"engine": "fast"},
]


@pytest.mark.parametrize("kwargs", BAD_ARGS, ids=lambda kw: next(iter(kw)))
def test_bad_arguments_are_refused_by_name(kwargs: dict[str, object], tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as err:
        resolve_options(tmp_path, **kwargs)  # type: ignore[arg-type]
    name = next(iter(kwargs))
    assert name in str(err.value) or "signal" in str(err.value).lower(), err.value


def test_successor_generation_and_signal_recorder_check_their_input() -> None:
    from hpcckpt.cluster.scontrol import successor_environment
    from hpcckpt.signals import SignalRecorder

    env = successor_environment({"_HPCCKPT_SUCCESSOR_GENERATION": "2", "SLURM_JOB_ID": "7"}, "7")
    assert env["_HPCCKPT_SUCCESSOR_GENERATION"] == "3" and "SLURM_JOB_ID" not in env
    with pytest.raises(ConfigError, match="_HPCCKPT_SUCCESSOR_GENERATION"):
        successor_environment({"_HPCCKPT_SUCCESSOR_GENERATION": "-1"}, "7")
    with pytest.raises(ConfigError, match="environment variable HPCCKPT_SUCCESSOR_GENERATION"):
        successor_environment({"HPCCKPT_SUCCESSOR_GENERATION": "-1"}, "7")  # the name older versions set
    with pytest.raises(ConfigError, match="SIGCHLD"):
        SignalRecorder([signal.SIGUSR2, signal.SIGCHLD])


def test_good_values_pass_with_units(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HPCCKPT_MEMORY_BUDGET_BYTES", "2GiB")
    monkeypatch.setenv("HPCCKPT_SIGNALS", "usr1, SIGTERM,USR1")
    monkeypatch.setenv("HPCCKPT_DEADLINE_MARGIN_S", "0")
    opts = resolve_options(tmp_path)
    assert opts.memory_budget_bytes == 2 << 30 and opts.deadline_margin_s == 0.0
    assert [s.name for s in opts.signals] == ["SIGUSR1", "SIGTERM"]
    monkeypatch.setenv("HPCCKPT_CHUNK_BYTES", "8M")
    assert from_env("CHUNK_BYTES", 1, int) == 8 << 20
    monkeypatch.setenv("HPCCKPT_CHUNK_BYTES", "1")  # read by the concurrent engine: checked all the same
    with pytest.raises(ConfigError, match="HPCCKPT_CHUNK_BYTES"):
        from_env("CHUNK_BYTES", 1, int)


def test_a_world_writable_checkpoint_directory_is_warned_about(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o777)
    with caplog.at_level(logging.WARNING, logger="hpcckpt.config"):
        resolve_options(shared)
    assert any("writable by every user" in r.getMessage() for r in caplog.records)
    caplog.clear()
    private = tmp_path / "private"
    private.mkdir(mode=0o700)
    with caplog.at_level(logging.WARNING, logger="hpcckpt.config"):
        resolve_options(private)
    assert not caplog.records


@pytest.mark.parametrize("text", ["B:KILL@60", "B:USR2@soon", "USR2@-5", "B:USR9@60", "B:USR2@nan"])
def test_doctor_refuses_a_script_signal_it_cannot_use(text: str) -> None:
    with pytest.raises(ConfigError, match="--signal"):
        SignalSpec.parse(text)


def _cli(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str]:
    try:
        code = main(argv)
    except SystemExit as exc:  # argparse's own usage errors
        code = int(exc.code or 0)
    out = capsys.readouterr()
    return code, out.out + out.err


@pytest.fixture()
def places(tmp_path: Path) -> dict[str, str]:
    a_file = tmp_path / "a-file"
    a_file.write_text("not a directory")
    script = tmp_path / "x.sbatch"
    script.write_text("#!/bin/bash\n")
    return {"FILE": str(a_file), "MISSING": str(tmp_path / "missing"), "RUNDIR": str(tmp_path / "run"),
            "NODIR_OUT": str(tmp_path / "no" / "such" / "x.sbatch")}


CLI_ROWS = [
    (["ls", "FILE"], "DIR"),
    (["history", "FILE"], "DIR"),
    (["requeue", "--dir", "FILE"], "--dir"),
    (["run", "--dir", "FILE", "--", "true"], "--dir"),
    (["verify", "--all", "MISSING"], "DIR"),
    (["verify", "FILE"], "DIR"),
    (["run", "--dir", "RUNDIR", "--signal", "KILL", "--", "true"], "--signal"),
    (["run", "--dir", "RUNDIR", "--signal", ",", "--", "true"], "--signal"),
    (["run", "--dir", "RUNDIR", "--signal", "SEGV", "--", "true"], "--signal"),
    (["run", "--dir", "RUNDIR", "--keep", "0", "--", "true"], "--keep"),
    (["run", "--dir", "RUNDIR", "--cuda-lock-timeout-s", "nan", "--", "true"], "--cuda-lock-timeout-s"),
    (["cuda", "state", "1", "--call-timeout-s", "-5"], "--call-timeout-s"),
    (["template", "single", "--set", "NOEQUALS"], "--set"),
    (["template", "single", "--out", "NODIR_OUT"], "NODIR_OUT"),
    (["doctor", "--script", "MISSING", "--no-plugins"], "--script"),
    (["doctor", "--dir", "FILE", "--no-plugins"], "--dir"),
]


@pytest.mark.parametrize(("argv", "named"), CLI_ROWS, ids=lambda v: " ".join(v) if isinstance(v, list) else v)
def test_bad_cli_input_exits_nonzero_naming_the_option(argv: list[str], named: str, places: dict[str, str],
                                                       capsys: pytest.CaptureFixture[str]) -> None:
    code, text = _cli([places.get(a, a) for a in argv], capsys)
    assert code != 0, text
    assert places.get(named, named) in text, text
    assert "Traceback" not in text


ENV_CLI_ROWS = [
    ({"HPCCKPT_CLUSTER": "bogus"}, ["requeue", "--dir", "RUNDIR"], "HPCCKPT_CLUSTER"),
    ({"HPCCKPT_REQUEUE_MAX_FAILURE": "-1"}, ["requeue", "--dir", "RUNDIR", "--cause", "failure"],
     "HPCCKPT_REQUEUE_MAX_FAILURE"),
    ({"HPCCKPT_REQUEUE_MAX_TIME_LIMIT": "many"}, ["requeue", "--dir", "RUNDIR", "--cause", "time_limit"],
     "HPCCKPT_REQUEUE_MAX_TIME_LIMIT"),
    ({"HPCCKPT_DIR": "FILE"}, ["requeue"], "HPCCKPT_DIR"),
    ({}, ["requeue", "--dir", "RUNDIR", "--cause", "lunch"], "--cause"),
]


@pytest.mark.parametrize(("env", "argv", "named"), ENV_CLI_ROWS, ids=lambda v: str(v))
def test_bad_environment_at_the_cli_exits_2_naming_the_variable(
        env: dict[str, str], argv: list[str], named: str, places: dict[str, str],
        capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    for key in ("SLURM_JOB_ID", "SLURM_JOBID", "HPCCKPT_CLUSTER", "HPCCKPT_DIR"):
        monkeypatch.delenv(key, raising=False)
    for key, value in env.items():
        monkeypatch.setenv(key, places.get(value, value))
    code, text = _cli([places.get(a, a) for a in argv], capsys)
    assert code == 2 and named in text and "Traceback" not in text, text


def test_the_real_command_prints_one_line_not_a_traceback(places: dict[str, str]) -> None:
    for argv in (["ls", places["FILE"]], ["run", "--dir", places["FILE"], "--", "true"]):
        proc = subprocess.run([sys.executable, "-m", "hpcckpt.cli", *argv], capture_output=True, text=True,
                              cwd=REPO, timeout=120, check=False)
        assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
        assert proc.stderr.strip().count("\n") == 0 and "not a directory" in proc.stderr


# -- every HPCCKPT_* variable the package reads is in the table and in the options reference --
# (docs/reference/options.md, generated from the table by scripts/gen-reference; tests/docs checks
# that the committed page is what the script generates now)

PACKAGE = REPO / "hpcckpt"
_READS = [
    re.compile(r'(?:environ|environ\(\))\s*(?:\.get\(|\[)\s*"(HPCCKPT_[A-Z0-9_]+)"'),  # environ.get / environ[...]
    re.compile(r'getenv\(\s*"(HPCCKPT_[A-Z0-9_]+)"'),
    re.compile(r'^[A-Z_]*ENV\s*=\s*"(HPCCKPT_[A-Z0-9_]+)"', re.M),  # a constant naming one, read through it
]
_CONFIG_READS = [  # config's readers take the name without the prefix
    (re.compile(r'\bfrom_env\(\s*"([A-Z0-9_]+)"'), lambda n: f"HPCCKPT_{n}"),
    (re.compile(r'\benv_value\(\s*"([a-z0-9_]+)"'), lambda n: _env_of(n)),
    # set by hpcckpt for its own processes (config.internal_var, read_internal, internal_source)
    (re.compile(r'\b(?:internal_var|read_internal|internal_source)\(\s*"([A-Z0-9_]+)"'), lambda n: f"_HPCCKPT_{n}"),
]


def _env_of(option: str) -> str:
    """The variable ``env_value(option)`` reads (an option the table lacks: its HPCCKPT_ name)."""
    from hpcckpt.config import TUNABLES
    return TUNABLES[option].env if option in TUNABLES else f"HPCCKPT_{option.upper()}"


def _read_variables() -> dict[str, set[str]]:
    found: dict[str, set[str]] = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        text = path.read_text(encoding="utf-8")
        where = str(path.relative_to(REPO))
        for rx in _READS:
            for name in rx.findall(text):
                found.setdefault(name, set()).add(where)
        for rx, full in _CONFIG_READS:
            for name in rx.findall(text):
                found.setdefault(full(name), set()).add(where)
    return found


def test_the_scan_finds_the_known_readers() -> None:
    found = _read_variables()
    # (the options with a keyword are read by resolve_options from the table itself: the next test)
    for name in ("HPCCKPT_DIR", "HPCCKPT_CRIU", "HPCCKPT_CRIU_PREFIX", "HPCCKPT_LIBCUDA",
                 "_HPCCKPT_CRIU_FALLBACK", "HPCCKPT_STAGING_ROOT", "_HPCCKPT_LOCAL_RESTART",
                 "HPCCKPT_CLUSTER", "HPCCKPT_END_TIME", "_HPCCKPT_CHECK_TRACE", "_HPCCKPT_BATCH_ARGS_JOB"):
        assert name in found, name


def test_every_variable_the_package_reads_is_in_the_table_and_the_options_reference() -> None:
    from hpcckpt.config import TUNABLES
    table = {t.env for t in TUNABLES.values()}
    page = (REPO / "docs" / "reference" / "options.md").read_text(encoding="utf-8")
    found = _read_variables()
    missing_table = {n: sorted(w) for n, w in found.items() if n not in table}
    assert not missing_table, f"read but not in config.TUNABLES: {missing_table}"
    missing_page = sorted(n for n in found | dict.fromkeys(table)
                          if not re.search(rf"`{re.escape(n)}`", page))
    assert not missing_page, (f"not in docs/reference/options.md: {missing_page}; run scripts/gen-reference "
                              "and commit the page")


# -- one table: a row with a keyword is its dataclass field, and nothing else lists it ------------

def _clear_env(monkeypatch: pytest.MonkeyPatch) -> None:
    import os
    for key in [k for k in os.environ if k.startswith("HPCCKPT_")]:
        monkeypatch.delenv(key)


def test_every_row_with_a_keyword_reaches_its_field_from_its_argument_and_its_variable(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from dataclasses import fields

    from hpcckpt.config import GROUPS, KEYWORDS, TUNABLES, CheckpointOptions
    _clear_env(monkeypatch)
    declared = {f.name: f for f in fields(CheckpointOptions)}
    assert set(declared) - {"dir", "auto_interval"} == set(KEYWORDS), "CheckpointOptions is the groups' fields"
    assert sorted(KEYWORDS) == sorted(f.name for g in GROUPS for f in fields(g)), "each field of a group is a row"
    defaults = resolve_options(tmp_path)
    for name in KEYWORDS:
        row = TUNABLES[name]
        assert row.env == f"HPCCKPT_{name.upper()}" and row.group, name
        assert getattr(defaults, name) == row.default == declared[name].default, name
        value = row.parse(row.example)
        assert value != row.default, f"{name}: the example must differ from the default, or this test could not fail"
        assert getattr(resolve_options(tmp_path, **{name: value}), name) == value, name
        monkeypatch.setenv(row.env, row.example)
        assert getattr(resolve_options(tmp_path), name) == value, row.env
        monkeypatch.delenv(row.env)


def test_the_concurrent_engine_takes_its_options_from_the_table(tmp_path: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    from hpcckpt.config import ConcurrentOptions, engine_options
    from hpcckpt.engines import SaveContext, make_engine
    from hpcckpt.ranks import Ranks
    _clear_env(monkeypatch)
    monkeypatch.setenv("HPCCKPT_ON_BUSY", "skip")
    ctx = SaveContext(root=tmp_path / "ckpt", keep=2, job={}, user={})
    engine = make_engine("concurrent", ctx, Ranks())
    try:
        assert engine.options == ConcurrentOptions() and engine.on_busy == "wait"  # type: ignore[attr-defined]
    finally:
        engine.close()
    given = resolve_options(tmp_path, max_async=2, direct=False)
    assert given.concurrent == ConcurrentOptions(max_async=2, direct=False, on_busy="skip")
    assert engine_options(max_async=2) == ConcurrentOptions(max_async=2, on_busy="skip")
    engine = make_engine("concurrent", ctx, Ranks(), given.concurrent, direct=True)
    try:
        assert (engine.max_async, engine.on_busy, engine.direct) == (2, "skip", True)  # type: ignore[attr-defined]
    finally:
        engine.close()
    with pytest.raises(ConfigError, match="max_async=0 is invalid"):
        ConcurrentOptions(max_async=0)
    with pytest.raises(TypeError, match="unknown option"):
        resolve_options(tmp_path, max_asink=2)


def test_every_steps_means_the_checkpoint_directorys_interval_with_or_without_levels(tmp_path: Path) -> None:
    from hpcckpt.config import TUNABLES
    plain = resolve_options(tmp_path, every_steps=100)
    levels = resolve_options(tmp_path, every_steps=100, local_every_steps=10)
    assert plain.every_steps == levels.every_steps == 100
    assert "checkpoint directory" in TUNABLES["every_steps"].rule
    assert resolve_options(tmp_path, every_steps="auto").auto_interval
    with pytest.raises(ConfigError, match="not a multiple of local_every_steps"):
        resolve_options(tmp_path, every_steps=15, local_every_steps=10)
    with pytest.raises(ConfigError, match="does not combine with local_every_steps"):
        resolve_options(tmp_path, every_steps="auto", local_every_steps=10)


def test_the_jit_timeout_has_one_rule() -> None:
    from hpcckpt.config import TUNABLES, check_jit_timeout
    assert check_jit_timeout(None) == TUNABLES["jit_timeout_s"].default
    assert check_jit_timeout(2) == 2.0
    for bad in (0.1, -1, 7200, float("nan"), True):
        with pytest.raises(ConfigError, match="jit_timeout_s=.* is invalid.*0.5 to 3600"):
            check_jit_timeout(bad)
