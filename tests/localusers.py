"""Unprivileged local users for the tests that play a second user (root only).

Each pytest-xdist worker gets users of its own: under work stealing two tests of one module can
run at once on two workers, and a test's cleanup (ending every process of its user, userdel)
must never touch the other test's processes or remove the user under it. A fresh-clone CI run
showed it: the epilog test on one worker killed the bystander process of the same test on
another worker."""
from __future__ import annotations

import os
import pwd
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass


@dataclass(frozen=True)
class LocalUser:
    name: str
    uid: int
    gid: int


def worker_name(base: str) -> str:
    """``base`` with this xdist worker's id (``hpcktest-a-gw3``); ``base`` outside xdist."""
    worker = os.environ.get("PYTEST_XDIST_WORKER", "")
    return f"{base}-{worker}" if worker else base


@contextmanager
def local_user(base: str) -> Iterator[LocalUser]:
    """This worker's user ``base``: made with useradd unless it exists, removed at the end if
    made here."""
    name = worker_name(base)
    created = False
    try:
        pw = pwd.getpwnam(name)
    except KeyError:
        subprocess.run(["useradd", "--no-create-home", "--user-group", "--shell", "/usr/sbin/nologin", name],
                       check=True, capture_output=True)
        pw, created = pwd.getpwnam(name), True
    try:
        yield LocalUser(name, pw.pw_uid, pw.pw_gid)
    finally:
        if created:
            subprocess.run(["userdel", name], check=False, capture_output=True)
