"""``dspark-produce --tui``: run the producer as a child process and watch it in the foreground."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

from dspark_cache.cli.conventions import UsageError
from dspark_cache.cli.lifetime import PARENT_DEATH_SIGNAL, exec_with_parent
from dspark_cache.format.paths import CachePaths
from dspark_cache.storage.remote.url import is_remote
from dspark_cache.tui.app import MonitorApp
from dspark_cache.tui.confirm import ConfirmStop
from dspark_cache.tui.fit import Para, words
from dspark_cache.tui.report import has_terminal
from dspark_cache.tui.snapshot import Snapshot


class ForegroundMonitor(MonitorApp):
    """The monitor, tied to the producer it started: ``q`` asks, then stops that producer gracefully."""

    QUIT_HELP = ("quit; while the producer runs, asks first, then stops it gracefully\n"
                 "     (it finishes the shards in flight; rerun to resume)")

    def __init__(self, path: str, child: subprocess.Popen, log_path: str) -> None:
        super().__init__(path)
        self.child = child
        self.log_path = log_path

    def show_snapshot(self, snap: Snapshot) -> None:
        """The monitor's panels, and once the producer has exited, its exit code instead of the notice."""
        super().show_snapshot(snap)
        code = self.child.poll()
        if code is not None:
            self.show_notice(Para([*words("producer exited with code $code", "bold", code=code),
                                   *words("(log: $log); press q to leave", log=self.log_path)], " "))

    def action_quit(self) -> None:
        """``q``: leave at once once the producer has exited; while it runs, ask before stopping it."""
        if self.child.poll() is not None:
            self.exit()
        elif not isinstance(self.screen, ConfirmStop):
            self.push_screen(ConfirmStop(self.log_path), self._quit_answered)

    def _quit_answered(self, stop: bool | None) -> None:
        if not stop:
            return
        if self.child.poll() is None:
            self.child.send_signal(signal.SIGTERM)  # finish the shards in flight, exit resumable
        self.exit()


def run_with_monitor(producer_argv: list[str], output_dir: str) -> int:
    """Start ``dspark-produce producer_argv`` and show the monitor until the user quits."""
    if is_remote(output_dir):  # its log and the screen's files would be a local directory named s3:/...
        raise UsageError(
            f"--tui watches an --output-dir on this machine; to watch {output_dir}, run dspark-produce "
            f"without --tui and dspark-monitor {output_dir} beside it"
        )
    paths = CachePaths(output_dir)
    log_dir = paths.logs_dir
    os.makedirs(log_dir, exist_ok=True)
    log_path = os.path.join(log_dir, f"produce-{time.strftime('%Y%m%d-%H%M%S')}.log")
    with open(log_path, "ab") as log:
        # If the monitor dies (even by SIGKILL) the producer is told: it stops at a shard boundary, resumable.
        child = subprocess.Popen(
            [sys.executable, "-m", "dspark_cache.producer", *producer_argv],
            stdout=log,
            stderr=subprocess.STDOUT,
            preexec_fn=exec_with_parent(PARENT_DEATH_SIGNAL),
        )
        try:
            # else no one could quit the app: the producer just runs, and its log tail is shown
            if has_terminal():
                ForegroundMonitor(paths.root, child, log_path).run()
        finally:
            code = child.wait()
    with open(log_path, encoding="utf-8", errors="replace") as log:
        tail = log.read().splitlines()[-3:]
    print("\n".join(tail))
    print(f"(full producer log: {log_path})")
    return code
