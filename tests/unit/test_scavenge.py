"""The scavenge (issue 25, item 3): a job killed without grace holds node-local step 29 while
its shared level holds step 20; ``hpcckpt scavenge`` on its nodes commits step 29 there,
verified, and the next allocation resumes from it.

The checkpoints are real: 2 gloo ranks on CPU as 2 nodes of 1 rank (tests/unit/dist_worker.py),
node-local + partner every step, shared every 10, killed at step 29 (no final save). Each test
works on its own copy: the shared directory at a new path, and each node's node-local root
renamed to that path's key, with its pointer rewritten, as the job would have written it.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from hpcckpt.cli.main import main as cli_main
from hpcckpt.store import catalog
from hpcckpt.store.commit import read_manifest
from hpcckpt.store.scavenge import COMMITTED, CURRENT, EMPTY, FAILED, PARTIAL, POINTER, level_key, scavenge, staging_dir
from tests.conftest import REPO
from tests.unit.test_distributed_state import assert_equal_states, dumps, result, run_world

pytestmark = [pytest.mark.native]

WORLD, KILLED_AT = 2, 29


@pytest.fixture(scope="module")
def killed(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A run killed at step 29: out/ckpt (shared: steps 10, 20), out/local/node-{0,1}/<key>/
    (node-local: steps 28, 29, each node holding both ranks' files: its own and its partner's)."""
    out = tmp_path_factory.mktemp("killed")
    run_world(out, WORLD, "--phase", "save", "--stop-at", "40", "--crash-at", str(KILLED_AT),
              "--ckpt", str(out / "ckpt"), "--local-every", "1", "--local-dir", str(out / "local" / "%n"),
              "--ranks-per-node", "1", "--every", "10")
    assert _newest(out / "ckpt") == 20
    return out


def _newest(shared: Path) -> int | None:
    steps = [i.step for i in catalog.committed_newest_first(shared)]
    return steps[0] if steps else None


def _clone(killed: Path, dst: Path) -> tuple[Path, list[Path]]:
    """(shared, [node-0 root, node-1 root]) copied under ``dst``, pointing at each other."""
    shared = dst / "shared dir; 'x'" / "ckpt"
    shutil.copytree(killed / "ckpt", shared, symlinks=True)
    roots = []
    for node in ("node-0", "node-1"):
        (src,) = (killed / "local" / node).iterdir()
        root = dst / "local" / node / level_key(shared)
        shutil.copytree(src, root, symlinks=True)
        doc = json.loads((root / POINTER).read_text())
        doc["shared"] = str(shared)
        (root / POINTER).write_text(json.dumps(doc))
        roots.append(root)
    return shared, roots


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), *filter(None, [os.environ.get("PYTHONPATH")])])}
    return subprocess.run([sys.executable, "-m", "hpcckpt.cli", "scavenge", *args], capture_output=True, text=True,
                          timeout=300, check=False, env=env)


def _flip(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01
    path.write_bytes(bytes(data))


def _leftovers(shared: Path) -> list[str]:
    return sorted(p.name for p in shared.iterdir() if ".tmp-" in p.name or p.name.startswith(".trash-"))


@pytest.mark.slow
def test_scavenge_commits_the_node_local_step_and_the_next_allocation_resumes_from_it(killed: Path,
                                                                                      tmp_path: Path) -> None:
    shared, (node0, node1) = _clone(killed, tmp_path)
    done = scavenge(node0)
    assert (done.status, done.step, done.ok) == (COMMITTED, KILLED_AT, True), done.message
    assert done.contributed == ["rank-0.pt", "rank-1.pt"] and "held step 20" in done.message
    assert _newest(shared) == KILLED_AT and (shared / "LATEST").read_text().strip() == f"step-{KILLED_AT}"
    assert _leftovers(shared) == []
    # the committed step is the node-local one: same manifest, every byte verifies
    assert read_manifest(shared / f"step-{KILLED_AT}") == read_manifest(node0 / f"step-{KILLED_AT}")
    verify = subprocess.run([sys.executable, "-m", "hpcckpt.cli", "verify", str(shared)], capture_output=True,
                            text=True, timeout=300, check=False, cwd=REPO)
    assert verify.returncode == 0 and f"step {KILLED_AT}: OK" in verify.stdout, verify.stdout + verify.stderr
    # the other node's scavenge (its epilog) finds the step there: nothing to do
    again = scavenge(node1)
    assert (again.status, again.ok) == (CURRENT, True), again.message
    ran = _cli(str(node1), "--json")
    assert ran.returncode == 0 and json.loads(ran.stdout)["status"] == CURRENT, ran.stdout + ran.stderr
    # the next allocation: fresh nodes (no node-local level), the same shared directory
    out = tmp_path / "next"
    run_world(out, WORLD, "--phase", "resume", "--total", "30", "--ckpt", str(shared), "--local-every", "1",
              "--local-dir", str(out / "local" / "%n"), "--ranks-per-node", "1", "--every", "10")
    for r in range(WORLD):
        assert (result(out, "resume", r)["restored"], result(out, "resume", r)["level"]) == (KILLED_AT, "shared")
    for r, (saved, restored) in enumerate(zip(dumps(killed, "saved", WORLD), dumps(out, "restored", WORLD))):
        assert_equal_states(restored, saved, f"rank {r}")


def test_two_nodes_holding_part_of_the_step_complete_each_other(killed: Path, tmp_path: Path) -> None:
    shared, (node0, node1) = _clone(killed, tmp_path)
    (node0 / f"step-{KILLED_AT}" / "rank-1.pt").unlink()  # each node holds only its own rank's file
    (node1 / f"step-{KILLED_AT}" / "rank-0.pt").unlink()
    first = _cli(str(node0), "--json")
    doc = json.loads(first.stdout)
    assert first.returncode == 0 and doc["status"] == PARTIAL, first.stdout + first.stderr
    assert (doc["contributed"], doc["missing"]) == (["rank-0.pt"], ["rank-1.pt"])
    assert _newest(shared) == 20
    manifest = read_manifest(node0 / f"step-{KILLED_AT}")
    assert sorted(p.name for p in staging_dir(shared, KILLED_AT, manifest).iterdir()) == ["rank-0.pt"]
    second = scavenge(node1)
    assert (second.status, second.contributed) == (COMMITTED, ["rank-1.pt"]), second.message
    info = catalog.inspect_step(shared, KILLED_AT, full=True)
    assert info is not None and info.status == "committed" and not info.problems
    assert _leftovers(shared) == []


@pytest.mark.slow
def test_two_nodes_scavenging_at_once_commit_the_step_once(killed: Path, tmp_path: Path) -> None:
    shared, roots = _clone(killed, tmp_path)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), *filter(None, [os.environ.get("PYTHONPATH")])])}
    procs = [subprocess.Popen([sys.executable, "-m", "hpcckpt.cli", "scavenge", str(root), "--json"],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env) for root in roots]
    outs = [p.communicate(timeout=300) for p in procs]
    docs = [json.loads(o) for o, _ in outs]
    assert [p.returncode for p in procs] == [0, 0], "\n".join(o + e for o, e in outs)
    assert sorted(d["status"] for d in docs) == [COMMITTED, CURRENT], docs  # whichever came first commits
    assert _newest(shared) == KILLED_AT and _leftovers(shared) == []
    info = catalog.inspect_step(shared, KILLED_AT, full=True)
    assert info is not None and not info.problems


def test_a_commit_by_another_node_while_this_one_verifies_is_current_not_a_failure(
        killed: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The race the concurrent case above can lose: node 1's scavenge commits the gathered
    step (renaming the staging directory into place) while node 0 reads it to verify."""
    shared, (node0, node1) = _clone(killed, tmp_path)
    (node1 / f"step-{KILLED_AT}" / "rank-0.pt").unlink()  # node 1 holds only its own rank's file
    assert scavenge(node1).status == PARTIAL  # rank 1's file gathered; rank 0's still missing
    real = catalog.verify_against
    raced: list[object] = []

    def verify_while_the_other_node_commits(path: Path, manifest: dict, full: bool = False) -> list[str]:
        if not raced and ".tmp-scavenge" in Path(path).name:  # node 0 reads the gathered step
            raced.append("node 1 runs")  # its own verification (inside) is not raced
            raced[0] = scavenge(node1)  # node 1 again: the step is whole now, it commits
        return real(path, manifest, full=full)

    monkeypatch.setattr(catalog, "verify_against", verify_while_the_other_node_commits)
    mine = scavenge(node0)
    assert raced and getattr(raced[0], "status", None) == COMMITTED, raced
    assert mine.status == CURRENT and mine.ok, mine.message
    assert _newest(shared) == KILLED_AT and _leftovers(shared) == []
    info = catalog.inspect_step(shared, KILLED_AT, full=True)
    assert info is not None and not info.problems


def test_a_damaged_node_local_file_is_not_committed_and_another_nodes_copy_is(killed: Path, tmp_path: Path) -> None:
    shared, (node0, node1) = _clone(killed, tmp_path)
    damaged = node0 / f"step-{KILLED_AT}" / "rank-1.pt"
    _flip(damaged)
    before = damaged.read_bytes()
    ran = _cli(str(node0))
    assert ran.returncode == 1 and "Traceback" not in ran.stderr, ran.stdout + ran.stderr
    line = ran.stdout.strip()
    assert "\n" not in line and line.startswith(f"{FAILED}:") and "damaged" in line and "rank-1.pt" in line, line
    assert _newest(shared) == 20 and not (shared / f"step-{KILLED_AT}").exists()
    assert damaged.read_bytes() == before and (node0 / f"step-{KILLED_AT}" / "rank-0.pt").exists()  # nothing lost
    healed = scavenge(node1)  # the partner's intact copy completes it
    assert (healed.status, healed.contributed) == (COMMITTED, ["rank-1.pt"]), healed.message
    assert _newest(shared) == KILLED_AT


def test_a_gathered_step_that_fails_full_verification_is_not_committed(killed: Path, tmp_path: Path) -> None:
    """A complete staging directory is re-read whole before the commit: a file damaged there
    after it was copied (same size, other bytes) stops it."""
    shared, (node0, node1) = _clone(killed, tmp_path)
    (node0 / f"step-{KILLED_AT}" / "rank-1.pt").unlink()
    assert scavenge(node0).status == PARTIAL
    staging = staging_dir(shared, KILLED_AT, read_manifest(node0 / f"step-{KILLED_AT}"))
    _flip(staging / "rank-0.pt")
    res = scavenge(node1)
    assert (res.status, res.ok) == (FAILED, False) and "fails verification" in res.message, res.message
    assert _newest(shared) == 20 and staging.is_dir()


def test_a_planted_symlink_in_the_staging_directory_is_refused(killed: Path, tmp_path: Path) -> None:
    shared, (node0, _node1) = _clone(killed, tmp_path)
    manifest = read_manifest(node0 / f"step-{KILLED_AT}")
    staging = staging_dir(shared, KILLED_AT, manifest)
    staging.mkdir()
    victim = tmp_path / "victim.pt"
    victim.write_bytes(b"v" * int(manifest["files"]["rank-1.pt"]["bytes"]))  # the right size, even
    (staging / "rank-1.pt").symlink_to(victim)
    res = scavenge(node0)
    assert (res.status, res.ok) == (FAILED, False) and "symbolic link" in res.message, res.message
    assert _newest(shared) == 20 and not (shared / f"step-{KILLED_AT}").exists()
    assert (staging / "rank-1.pt").is_symlink() and victim.read_bytes()[:1] == b"v"

    shutil.rmtree(staging)  # the staging directory itself a symlink: nothing is written through it
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    staging.symlink_to(elsewhere)
    res = scavenge(node0)
    assert (res.status, res.ok) == (FAILED, False) and "symbolic link" in res.message, res.message
    assert list(elsewhere.iterdir()) == [] and _newest(shared) == 20


def test_odd_directories_give_one_line_messages_and_commit_nothing(killed: Path, tmp_path: Path,
                                                                   capsys: pytest.CaptureFixture[str]) -> None:
    shared, (node0, node1) = _clone(killed, tmp_path)

    def refused(root: Path, *words: str) -> None:
        code = cli_main(["scavenge", str(root)])  # the verb in this process (the subprocess form: above)
        out, err = capsys.readouterr()
        assert code == 1 and err == "", out + err
        line = out.strip()
        assert "\n" not in line and line.startswith(f"{FAILED}:") and all(w in line for w in words), line
        assert _newest(shared) == 20 and _leftovers(shared) == []

    refused(tmp_path / "nowhere", "cannot be read")
    refused(tmp_path, "no .hpcckpt-level.json")
    pointer = (node0 / POINTER).read_text()
    (node0 / POINTER).write_text("{not json")
    refused(node0, "not valid JSON")
    (node0 / POINTER).write_text(json.dumps({"shared": str(tmp_path / "other"), "python": sys.executable}))
    refused(node0, "copied from elsewhere")
    (node0 / POINTER).write_text(pointer)
    (node0 / f"step-{KILLED_AT}" / "manifest.json").write_text("{}")
    refused(node0, "damaged manifest")
    (node1 / POINTER).unlink()
    (node1 / POINTER).symlink_to(node0 / POINTER)
    refused(node1, "cannot be used")
    link = tmp_path / "link"
    link.symlink_to(node0)
    refused(link, "symbolic link")


def test_nothing_to_do_is_not_an_error(killed: Path, tmp_path: Path) -> None:
    shared, (node0, node1) = _clone(killed, tmp_path)
    for p in node1.iterdir():
        if p.name.startswith("step-"):
            shutil.rmtree(p)
    res = scavenge(node1)
    assert (res.status, res.ok) == (EMPTY, True), res.message
    shutil.copytree(node0 / f"step-{KILLED_AT}", shared / "step-30")  # a newer shared step (another run's)
    (shared / "step-30" / "manifest.json").unlink()  # not committed: the shared level's newest stays 20
    res = scavenge(node0)
    assert (res.status, res.ok) == (COMMITTED, True), res.message
    shutil.rmtree(shared / "step-30")
    res = scavenge(node0)
    assert (res.status, res.ok) == (CURRENT, True), res.message


def test_an_uncommitted_shared_step_of_the_same_number_is_never_replaced(killed: Path, tmp_path: Path) -> None:
    shared, (node0, _node1) = _clone(killed, tmp_path)
    evidence = shared / f"step-{KILLED_AT}"
    evidence.mkdir()
    (evidence / "rank-0.pt").write_bytes(b"half")
    res = scavenge(node0)
    assert (res.status, res.ok) == (FAILED, False) and "never replaces" in res.message, res.message
    assert sorted(p.name for p in evidence.iterdir()) == ["rank-0.pt"] and _newest(shared) == 20
