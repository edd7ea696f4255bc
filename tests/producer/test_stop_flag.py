"""The producer's stop flag: a second SIGINT/SIGTERM aborts the shard in flight; the notice that our
parent died, which the kernel repeats as a killed parent's threads exit one by one, only stops."""

from __future__ import annotations

import os
import signal
import time

import pytest

from dspark_cache.cli.lifetime import PARENT_DEATH_SIGNAL
from dspark_cache.format.paths import CachePaths
from dspark_cache.producer.report.signals import StopFlag


def _deliver(sig: int) -> None:
    os.kill(os.getpid(), sig)
    time.sleep(0.05)  # the handler runs here, in the main thread


def test_repeated_parent_death_notices_stop_once_and_a_second_signal_aborts(tmp_path):
    flag = StopFlag(CachePaths(str(tmp_path)))
    flag.install()
    try:
        for _ in range(4):  # one for each of the dying agent's threads, however late they are handled
            _deliver(PARENT_DEATH_SIGNAL)
        assert flag() and flag.reason == "parent process died"
        _deliver(signal.SIGTERM)  # a scheduler's SIGTERM to the job after that: still a graceful stop
        assert flag()
        with pytest.raises(KeyboardInterrupt):  # the user's second one: abort now
            _deliver(signal.SIGTERM)
    finally:
        flag.uninstall()


def test_a_signal_after_the_monitors_request_aborts(tmp_path):
    paths = CachePaths(str(tmp_path))
    os.makedirs(paths.control_dir)
    open(paths.stop_request, "w").close()
    flag = StopFlag(paths)
    flag.install()
    try:
        assert flag() and flag.reason == "stop requested by the monitor"
        _deliver(PARENT_DEATH_SIGNAL)
        assert flag.reason == "stop requested by the monitor"
        with pytest.raises(KeyboardInterrupt):
            _deliver(signal.SIGINT)
    finally:
        flag.uninstall()
