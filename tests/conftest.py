"""Shared fixtures: fresh checkpoint directories with awkward names, a tiny train state."""
from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests import stacks

REPO = Path(__file__).resolve().parents[1]
stacks.install()  # a wait on a process that runs out says where that process was


@pytest.fixture
def ckdir(tmp_path: Path) -> Path:
    """A checkpoint dir whose path has a space, a quote and a semicolon in it."""
    d = tmp_path / "run 'a';b" / "ckpt"
    return d


@pytest.fixture
def python() -> str:
    return sys.executable


@pytest.fixture(autouse=True)
def _isolated_env(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    # Tests outside Slurm tiers must not see a surrounding job's environment.
    import os
    for k in list(os.environ):
        if k.startswith(("HPCCKPT_", "_HPCCKPT_")):  # options, and what hpcckpt sets for itself
            monkeypatch.delenv(k, raising=False)
    yield


_STOP_SIGNALS = ("SIGTERM", "SIGINT", "SIGUSR1", "SIGUSR2", "SIGHUP", "SIGCONT")


@pytest.fixture(autouse=True)
def _signal_handlers_restored() -> Iterator[None]:
    """Each test starts with the stop signals' handlers the worker started with: one that left
    a recorder installed (it raised before its Checkpointer closed) must not change what a
    later test on the same worker finds."""
    import signal
    import threading
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    before = {name: signal.getsignal(getattr(signal, name)) for name in _STOP_SIGNALS}
    yield
    for name, handler in before.items():
        if signal.getsignal(getattr(signal, name)) is not handler and handler is not None:
            signal.signal(getattr(signal, name), handler)


def _weight(item: pytest.Item) -> int:
    """Long first: real-Slurm tests wait on Slurm's clocks, `slow` ones run whole trainings."""
    marks = {m.name for m in item.iter_markers()}
    return 0 if "slurm" in marks else 1 if "slow" in marks or "criu" in marks else 2


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Under pytest-xdist every worker gets its share of the real-Slurm tests spread through its
    queue. The work-stealing scheduler hands each worker one contiguous part of this list; each
    part holds every N-th real-Slurm test (long first) and every N-th other test (`slow` and
    `criu` ones first), merged so the Slurm tests sit evenly among the others in the first 70%
    of it: at any moment some workers wait on Slurm's clocks while the others use the cores,
    and the run ends on short tests, which work stealing evens out across the workers.
    Measured on the 2-core machine (fresh-clone runs): the longest Slurm tests, dealt among the
    others, still started late (the three preemptions at 947 s of a 1112 s run); with the list only sorted, one worker got
    every Slurm test and ran them one at a time (pytest 20:17); dealt to the front of every
    worker, all waited at once for the first ten minutes with the cores 1.0-1.8 busy and the
    CPU-bound tiers came after (slower). A run without workers is unchanged but for the sort."""
    import os
    if not os.environ.get("PYTEST_XDIST_WORKER"):
        return
    items.sort(key=_weight)  # every worker collects, sorts and deals the same way
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    if workers < 2:
        return
    # The longest Slurm tests (``long(seconds)``) first, longest first: each worker gets its
    # share of them, started early and staggered (worker k's j-th of L at 4k + 50j/L % of its
    # queue), so that none of them is what the run waits for at its end.
    waits = sorted((item for item in items if _weight(item) == 0), key=lambda i: -_long_s(i))
    rest = [item for item in items if _weight(item) != 0]
    order: list[pytest.Item] = []
    for k in range(workers):
        mine_waits, mine_rest = waits[k::workers], rest[k::workers]
        longs = sum(1 for item in mine_waits if _long_s(item))
        # in the first 70% of the queue: the last part is short tests, which stealing evens out
        placed = [((0.04 * k + 0.5 * n / longs) if n < longs else 0.7 * n / len(mine_waits), 0, n)
                  for n in range(len(mine_waits))]
        placed += [(n / len(mine_rest), 1, n) for n in range(len(mine_rest))]
        for _, kind, n in sorted(placed):
            order.append(mine_waits[n] if kind == 0 else mine_rest[n])
    items[:] = order


def _long_s(item: pytest.Item) -> float:
    """The seconds a ``long`` test takes on the 2-core machine (0 when it is not marked)."""
    mark = item.get_closest_marker("long")
    return float(mark.args[0]) if mark is not None and mark.args else 0.0


# Opt-in cost profile of the suite (TEST_CPU_PROFILE=dir): one JSON line per test with its
# wall time and the CPU it and the children it waited for used, per worker; and the whole
# machine's CPU use every second, from the controller. Used to find where the suite's time
# goes; nothing is asserted on it.
_PROFILE = os.environ.get("TEST_CPU_PROFILE")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> Iterator[None]:
    if not _PROFILE:
        yield
        return
    import json
    import time
    t0, c0 = time.time(), os.times()
    yield
    t1, c1 = time.time(), os.times()
    rec = {"id": item.nodeid, "start": t0, "wall": t1 - t0,
           "cpu_self": (c1.user + c1.system) - (c0.user + c0.system),
           "cpu_children": (c1.children_user + c1.children_system) - (c0.children_user + c0.children_system)}
    worker = os.environ.get("PYTEST_XDIST_WORKER", "main")
    with open(os.path.join(_PROFILE, f"tests-{worker}.jsonl"), "a") as f:
        f.write(json.dumps(rec) + "\n")


def pytest_configure(config: pytest.Config) -> None:
    if not _PROFILE or os.environ.get("PYTEST_XDIST_WORKER"):
        return
    import threading
    import time
    os.makedirs(_PROFILE, exist_ok=True)

    def sample() -> None:
        with open(os.path.join(_PROFILE, "machine.tsv"), "a") as out:
            while True:
                with open("/proc/stat") as f:
                    fields = f.readline().split()[1:]
                out.write(f"{time.time():.1f}\t" + "\t".join(fields) + "\n")
                out.flush()
                time.sleep(1.0)

    threading.Thread(target=sample, daemon=True).start()
