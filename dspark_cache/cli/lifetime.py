"""Processes we start end with the process that started them, whatever ended it (SIGKILL included).

A child blocked on a pipe it holds both ends of (a forked pool worker waiting for work) never
sees its parent go; a scheduler that preempts with SIGKILL would leak one per child per
preemption. So every child asks the kernel for a signal when its parent dies
(``prctl(PR_SET_PDEATHSIG)`` on Linux; elsewhere a thread that watches the parent's pid), then
checks that the parent it expects is still its parent, since the parent may have died before
the request was made.

Linux sends that signal when the *thread* that started the child ends, not the process: start
children from a thread that lives as long as they should (we start them from the main thread).
A dying parent with several threads hands the child to each next thread in turn, and the signal
comes again each time, while ``getppid()`` still names the dying parent. A child that stops
gracefully therefore gets :data:`PARENT_DEATH_SIGNAL`, which means nothing else, rather than a
SIGTERM whose repeats it could not tell from a user's second SIGTERM (producer.report.signals).
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys
import threading
import time
from typing import Callable

_PR_SET_PDEATHSIG = 1  # <linux/prctl.h>
# What our own programs that stop gracefully (a torchrun rank of the producer, the monitor's producer) get
# when their parent dies. SIGUSR2: nothing we run sends it, and nohup does not ignore it, as it does SIGHUP.
PARENT_DEATH_SIGNAL = signal.SIGUSR2
_WATCH_S = 0.5  # how often the fallback thread looks at the parent's pid


def _prctl() -> Callable[..., int] | None:
    """libc's ``prctl`` (Linux), looked up before any fork: a child between fork and exec must not load anything."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        return ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):  # an unusual libc: fall back to watching
        return None


def _ask_kernel(prctl: Callable[..., int] | None, sig: int) -> bool:
    """Whether the kernel will send ``sig`` to this process when its parent dies."""
    return prctl is not None and prctl(_PR_SET_PDEATHSIG, int(sig), 0, 0, 0) == 0


def _end_if_orphaned(parent: int, sig: int) -> None:
    if os.getppid() != parent:
        os.kill(os.getpid(), sig)


def _watch(parent: int, sig: int) -> None:
    while True:
        _end_if_orphaned(parent, sig)
        time.sleep(_WATCH_S)


def die_with_parent(parent: int, sig: int = signal.SIGKILL) -> None:
    """In a forked child that keeps running Python: receive ``sig`` once ``parent`` (its pid) dies."""
    if not _ask_kernel(_prctl(), sig):
        threading.Thread(target=_watch, args=(parent, sig), name="dspark-parent-watch", daemon=True).start()
    _end_if_orphaned(parent, sig)


def exec_with_parent(sig: int = signal.SIGTERM) -> Callable[[], None] | None:
    """A ``preexec_fn`` for ``subprocess.Popen``: the program it runs receives ``sig`` when we die.

    The request survives ``exec`` (Linux keeps it for programs that are not set-uid). None where
    the kernel offers no such request: a watching thread would not survive ``exec``.
    """
    prctl, parent = _prctl(), os.getpid()
    if prctl is None:
        return None

    def preexec() -> None:  # runs in the child between fork and exec: nothing that could take a lock
        _ask_kernel(prctl, sig)
        _end_if_orphaned(parent, sig)

    return preexec
