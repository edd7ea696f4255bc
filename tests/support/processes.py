"""Processes a run leaves behind, found two ways: by a marker in the environment its children
inherit (a survivor is found in ``/proc`` even after it was reparented), and in the process tree
while it runs (so a check that none survived is not vacuous). Linux only: it walks ``/proc``.
"""

from __future__ import annotations

import os
import signal
import time

MARKER = "DSPARK_ORPHAN_TEST_RUN"


def process_stat(pid: int) -> tuple[str, int, int] | None:
    """(state, parent pid, start time) of a live process, None when it is gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as handle:
            fields = handle.read().rsplit(b")", 1)[1].split()
    except OSError:
        return None
    return fields[0].decode(), int(fields[1]), int(fields[19])


def _pids() -> list[int]:
    return [int(name) for name in os.listdir("/proc") if name.isdigit()]


def descendants(root: int) -> set[tuple[int, int]]:
    """(pid, start time) of every live descendant of ``root``."""
    children: dict[int, list[int]] = {}
    starts: dict[int, int] = {}
    for pid in _pids():
        info = process_stat(pid)
        if info is not None and info[0] != "Z":
            children.setdefault(info[1], []).append(pid)
            starts[pid] = info[2]
    found, todo = set(), [root]
    while todo:
        for child in children.get(todo.pop(), []):
            found.add((child, starts[child]))
            todo.append(child)
    return found


def marked(run: str) -> set[int]:
    """Live (not zombie) processes whose environment carries this run's marker."""
    needle = f"{MARKER}={run}".encode()
    out = set()
    for pid in _pids():
        try:
            with open(f"/proc/{pid}/environ", "rb") as handle:
                env = handle.read().split(b"\0")
        except OSError:
            continue
        info = process_stat(pid)
        if needle in env and info is not None and info[0] != "Z":
            out.add(pid)
    return out


def alive(procs: set[tuple[int, int]]) -> set[int]:
    return {pid for pid, started in procs
            if (info := process_stat(pid)) is not None and info[0] != "Z" and info[2] == started}


def wait_gone(procs: set[tuple[int, int]], run: str, within: float) -> set[int]:
    """Wait up to ``within`` s for ``procs`` and every process of ``run`` to end; the ones left."""
    deadline = time.monotonic() + within
    while (left := alive(procs) | marked(run)) and time.monotonic() < deadline:
        time.sleep(0.05)
    return left


def kill_marked(run: str) -> None:
    """Only processes of this run: never leave them behind, even when a test fails."""
    for pid in marked(run):
        os.kill(pid, signal.SIGKILL)
