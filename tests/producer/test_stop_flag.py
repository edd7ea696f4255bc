"""The producer's stop flag: a second SIGTERM aborts, but the kernel's parent-death notice, which comes
again as a killed parent's threads exit one by one, is one stop however late its handler runs."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from dspark_cache.format.paths import CachePaths
from dspark_cache.producer.report.signals import StopFlag


def _zombie() -> subprocess.Popen:
    """A child that has exited and is not reaped yet: a parent that is dying."""
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        with open(f"/proc/{child.pid}/stat", "rb") as handle:
            if handle.read().rpartition(b")")[2].split()[0] == b"Z":
                return child
        time.sleep(0.01)
    raise AssertionError("the child did not exit")


@pytest.mark.skipif(not os.path.isdir("/proc/self"), reason="needs /proc")
def test_a_repeated_notice_from_a_dying_parent_is_one_stop_and_a_second_signal_aborts(tmp_path):
    flag = StopFlag(CachePaths(str(tmp_path)))
    flag.install()
    try:
        parent = _zombie()
        flag._parent = parent.pid  # as if that process had started us, and was killed
        os.kill(os.getpid(), signal.SIGTERM)
        assert flag() and flag.reason == "SIGTERM"
        flag._first_at -= 60  # the repeat's handler runs long after the first (a main thread in a long call)
        os.kill(os.getpid(), signal.SIGTERM)  # while the dying parent is still our parent: a notice, not an abort
        parent.wait()
        os.kill(os.getpid(), signal.SIGTERM)  # and once it is gone
        assert flag()
        flag._parent = os.getppid()  # a parent alive and well: the second signal is the user's
        with pytest.raises(KeyboardInterrupt):
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(1)  # the handler runs here
    finally:
        flag.uninstall()
