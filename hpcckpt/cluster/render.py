"""sbatch/submitit templates: ``{{KEY}}`` placeholders filled from defaults and overrides.

The template texts live beside this module (package data, so an installed hpcckpt
renders them too); jobscripts/ holds each rendered with its defaults.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from importlib import resources

from hpcckpt.errors import ConfigError

_COMMON = {
    "JOB_NAME": "hpcckpt-train",
    "TIME": "04:00:00",
    "SIGNAL": "USR2",
    "LEAD_S": "180",
    "CPUS_PER_TASK": "1",
    "OUTPUT": "hpcckpt-%x-%j.out",
    "RUN_DIR": "$PWD/hpcckpt-run",
    # "plain": #SBATCH --requeue; "expedite": --requeue=expedite (Slurm >= 25.11: a requeued job
    # starts again first). `hpcckpt template` picks expedite where the local Slurm has it.
    "REQUEUE": "plain",
}
REQUEUE_MODES = {"plain": "--requeue", "expedite": "--requeue=expedite"}
EXPEDITE_SINCE = (25, 11)


@dataclass(frozen=True, kw_only=True)
class Template:
    name: str
    source: str
    output_name: str
    description: str
    defaults: dict[str, str] = field(default_factory=dict)

    def text(self) -> str:
        return resources.files("hpcckpt.cluster").joinpath("templates").joinpath(self.source).read_text(encoding="utf-8")


TEMPLATES: dict[str, Template] = {t.name: t for t in (
    Template(name="single", source="single.sbatch.in", output_name="single.sbatch",
             description="one node, one process; --signal=B: to the exec'd training process",
             defaults={**_COMMON, "COMMAND":
                       'python -m hpcckpt.demo.train --dir "$HPCCKPT_RUN_DIR" --steps 2000'}),
    Template(name="ddp", source="ddp.sbatch.in", output_name="ddp.sbatch",
             description="multi-node DDP under srun; step-delivered signal; batch script requeues",
             defaults={**_COMMON, "NODES": "2", "TASKS_PER_NODE": "2", "RESTARTS": "0", "COMMAND":
                       'python -m hpcckpt.demo.train --dir "$HPCCKPT_RUN_DIR" --steps 2000'}),
    Template(name="lightning", source="lightning.sbatch.in", output_name="lightning.sbatch",
             description="PyTorch Lightning under srun with HpcckptCallback; batch script requeues",
             defaults={**_COMMON, "JOB_NAME": "hpcckpt-lightning", "NODES": "1", "TASKS_PER_NODE": "1",
                       "COMMAND": 'python train.py --ckpt "$HPCCKPT_DIR"'}),
    Template(name="torchrun", source="torchrun.sbatch.in", output_name="torchrun.sbatch",
             description="torchrun per node under srun (MAX_RESTARTS>0: c10d rendezvous); batch script requeues",
             defaults={**_COMMON, "JOB_NAME": "hpcckpt-torchrun", "NODES": "2", "PROCS_PER_NODE": "2",
                       "MAX_RESTARTS": "0", "COMMAND": 'train.py --ckpt "$HPCCKPT_DIR"'}),
    Template(name="criu", source="criu.sbatch.in", output_name="criu.sbatch",
             description="transparent mode: hpcckpt run --mode criu around an unmodified command",
             defaults={**_COMMON, "JOB_NAME": "hpcckpt-criu", "CPUS_PER_TASK": "2", "DUMP_EVERY_S": "0"}),
    Template(name="own", source="own.sbatch.in", output_name="own.sbatch",
             description="a script that keeps its own checkpoints: one notice at the lead, requeue on exit 75",
             defaults={**_COMMON, "JOB_NAME": "hpcckpt-own", "NOTICE": "TERM", "REQUEUE_ON": "75",
                       "SAVES": "", "COMMAND": 'python train.py --resume "$HPCCKPT_RUN_DIR/checkpoint.pt"'}),
    Template(name="submitit", source="submitit.py.in", output_name="submitit_launcher.py",
             description="submitit AutoExecutor launcher (Checkpointable + @preemptible)",
             defaults={"JOB_NAME": "hpcckpt-train", "TIME_MIN": "240", "LEAD_S": "180",
                       "CPUS_PER_TASK": "1", "STEPS": "2000",
                       "SCRIPT_NAME": "submitit_launcher.py"}),
)}

_PLACEHOLDER = re.compile(r"\{\{([A-Z_]+)\}\}")


def get(name: str) -> Template:
    try:
        return TEMPLATES[name]
    except KeyError:
        raise ConfigError(f"no template {name!r}; available: {', '.join(sorted(TEMPLATES))} "
                          "(hpcckpt template --list)") from None


def render(name: str, overrides: dict[str, str] | None = None) -> str:
    """The template ``name`` with every placeholder filled; unknown keys are errors."""
    tpl = get(name)
    values = {**tpl.defaults, **(overrides or {})}
    unknown = set(overrides or {}) - set(tpl.defaults)
    if name == "criu" and "NODES" in unknown and str((overrides or {})["NODES"]).strip() != "1":
        raise ConfigError("template 'criu' runs on one node: CRIU dumps the process tree of one node, and the "
                          "ranks on other nodes run outside it. For several nodes use an in-process template: "
                          "hpcckpt template ddp (srun) or hpcckpt template torchrun, with hpcckpt's Checkpointer")
    if unknown:
        raise ConfigError(f"template {name!r} has no parameter(s) {sorted(unknown)}; "
                          f"it takes {sorted(tpl.defaults)}")
    for key, value in values.items():
        if "\n" in value and key != "COMMAND":
            raise ConfigError(f"template parameter {key} must be one line, got {value!r}")
        _check_value(key, value)
    quoted = {key: _quote(key, value) for key, value in values.items()}
    return _PLACEHOLDER.sub(lambda m: quoted[m.group(1)], tpl.text())


# Values that land in `#SBATCH --opt=VALUE` lines: sbatch splits those at blanks
# unless the value is double-quoted, and cannot carry a double quote at all.
_SBATCH_VALUES = {"JOB_NAME", "OUTPUT"}
# Values that land inside a double-quoted shell string: `$` stays live on purpose
# (the default RUN_DIR is "$PWD/..."), everything else is taken literally.
_SHELL_DQ_VALUES = {"RUN_DIR", "NOTICE", "REQUEUE_ON", "SAVES"}


_SLURM_TIME = re.compile(r"^(\d+-)?\d+(:\d{1,2}){0,2}$|^(?i:unlimited|infinite)$")
_COUNTS = {"CPUS_PER_TASK", "NODES", "TASKS_PER_NODE", "PROCS_PER_NODE", "TIME_MIN", "STEPS"}


def _check_value(key: str, value: str) -> None:
    """A value sbatch could not read is refused here, naming the parameter and an example."""
    if key == "SIGNAL":
        from hpcckpt.config import parse_signal

        try:
            parse_signal(value)
        except ConfigError:
            raise ConfigError(f"template parameter SIGNAL={value!r}: `#SBATCH --signal` takes ONE signal, e.g. "
                              "SIGNAL=USR2 (the criu template dumps on TERM as well already)") from None
    elif key == "LEAD_S" and not (value.isdigit() and int(value) <= 65535):
        raise ConfigError(f"template parameter LEAD_S={value!r}: whole seconds 0-65535, e.g. LEAD_S=180")
    elif key == "TIME" and not _SLURM_TIME.match(value):
        raise ConfigError(f"template parameter TIME={value!r}: a Slurm time such as 04:00:00, 90, 1-12:00:00")
    elif key in _COUNTS and not (value.isdigit() and int(value) > 0):
        raise ConfigError(f"template parameter {key}={value!r}: a whole number > 0, e.g. {key}=2")
    elif key in ("RESTARTS", "MAX_RESTARTS") and not value.isdigit():
        raise ConfigError(f"template parameter {key}={value!r}: a whole number >= 0 of restarts of the ranks "
                          f"inside one allocation (0: none), e.g. {key}=3")
    elif key == "REQUEUE" and value not in REQUEUE_MODES:
        raise ConfigError(f"template parameter REQUEUE={value!r}: plain (#SBATCH --requeue) or expedite "
                          "(--requeue=expedite, Slurm >= 25.11), e.g. REQUEUE=expedite")
    elif key == "REQUEUE_ON" and not re.fullmatch(r"\d{1,3}(,\d{1,3})*", value):
        raise ConfigError(f"template parameter REQUEUE_ON={value!r}: exit statuses, comma-separated, e.g. 75 or 75,3")
    elif key == "NOTICE" and not re.fullmatch(r"(SIG)?(TERM|INT|USR1|USR2|HUP)|file(:.+)?", value):
        raise ConfigError(f"template parameter NOTICE={value!r}: the signal the script catches (TERM, USR1, USR2, "
                          "INT) or file[:PATH] (a file it polls), e.g. NOTICE=TERM")
    elif key == "DUMP_EVERY_S" and not re.fullmatch(r"\d+(\.\d+)?", value):
        raise ConfigError(f"template parameter DUMP_EVERY_S={value!r}: seconds >= 0 (0: off), e.g. 600")


def _quote(key: str, value: str) -> str:
    if key == "REQUEUE":
        return REQUEUE_MODES[value]
    if key in _SBATCH_VALUES:
        if '"' in value:
            raise ConfigError(f"template parameter {key}={value!r}: sbatch directives cannot hold a "
                              "double quote; choose a name/path without one")
        return f'"{value}"' if any(c.isspace() or c in "'#;" for c in value) else value
    if key in _SHELL_DQ_VALUES:
        return value.replace("\\", "\\\\").replace('"', '\\"').replace("`", "\\`")
    return value
