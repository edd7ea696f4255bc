"""The server dies in the middle of a run (SIGKILL) and comes back on the same port: the requests in
flight fail, the endpoint leaves the rotation, is tried again, and the run ends with every row, the
same bytes as an uninterrupted run. Its own server (the module's), since this test kills it."""

from __future__ import annotations

import time

import pytest

from tests.support.faultproxy import FaultProxy
from tests.support.proc import wait_for
from tests.support.regenerate import count_lines, regenerate, start_regenerate

pytestmark = pytest.mark.slow


def test_server_killed_mid_run_then_restarted(server, embedded, tmp_path):
    reference = tmp_path / "reference.jsonl"
    assert regenerate([server.url], embedded.data, str(reference), "--concurrency", "4").returncode == 0
    out = tmp_path / "regen.jsonl"
    proc = start_regenerate([server.url], embedded.data, str(out), "--concurrency", "4", "--log-level", "INFO")
    wait_for(lambda: count_lines(str(out)) >= 5 or proc.poll() is not None, timeout=120)
    server.kill()
    killed_at = count_lines(str(out))
    time.sleep(2)  # the run is left with no endpoint for a while: it must wait, not fail the rows
    assert proc.poll() is None, proc.communicate()
    server.start()
    stdout, stderr = proc.communicate(timeout=300)
    assert proc.returncode == 0, stderr
    assert killed_at < count_lines(str(reference)), "the run finished before the server was killed"
    assert "is down" in stderr and "answers again" in stderr
    assert "0 failed" in stdout
    assert out.read_bytes() == reference.read_bytes()


def test_server_gone_for_good_stops_the_run_with_one_line(server, embedded, tmp_path):
    """The run's only endpoint dies for good: a proxy in front of the server, stopped (its port refuses, its
    connections are cut, as when a server is killed), so that the module's server need not start again."""
    out = tmp_path / "regen.jsonl"
    proxy = FaultProxy("127.0.0.1", server.port, dialect="openai").start()
    try:
        proc = start_regenerate([proxy.endpoint], embedded.data, str(out), "--concurrency", "2", "--give-up-after",
                                "3")
        wait_for(lambda: count_lines(str(out)) >= 2 or proc.poll() is not None, timeout=120)
        proxy.stop()
        _, stderr = proc.communicate(timeout=120)
    finally:
        proxy.stop()
    assert proc.returncode == 1
    assert stderr.strip().splitlines()[-1].startswith("dspark-regenerate: error: no endpoint answered for 3 s: ")
    assert proxy.endpoint in stderr.strip().splitlines()[-1]
    assert not (tmp_path / "regen.jsonl.failed").exists(), "rows in flight are not failed rows: a rerun resumes them"
    done = regenerate([server.url], embedded.data, str(out), "--concurrency", "2")  # the endpoint is not identity
    assert done.returncode == 0, done.stderr
    assert count_lines(str(out)) == 48
