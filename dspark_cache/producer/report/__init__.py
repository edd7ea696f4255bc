"""What a running producer tells people and the monitor, and how it is asked to stop.

* ``status``: the per-rank heartbeat file and event log (``StatusReporter``), and the plan's
  announcement (``announce``).
* ``progress``: a bar on a terminal, periodic log lines elsewhere (``counter``, ``ProgressLog``,
  ``set_progress``).
* ``signals``: SIGINT/SIGTERM or the monitor's stop file end the run at a shard boundary
  (``StopFlag``).
* ``summary``: rank 0's last line, counted from the published indexes (``summary``), and what
  ``--dry-run`` prints (``plan_report``).

The rest of the producer uses the names above.
"""
