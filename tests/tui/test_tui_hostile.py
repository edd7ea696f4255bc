"""The monitor against hostile or corrupt cache directories: it must never hang, grow without
bound or crash, and must say what it skipped.

Hangs and memory are checked in a child process (a hung ``open`` cannot be interrupted in this
one, and a runaway allocation must not take the test machine down): ``watch_in_child`` runs the
real app under Textual's pilot there, with a timeout and an address-space limit.
"""

from __future__ import annotations

import asyncio
import json
import math
import os
import resource
import subprocess
import sys
from typing import Callable

import msgspec
import pytest

from dspark_cache.format.paths import CachePaths
from dspark_cache.tui.app import MonitorApp
from dspark_cache.tui.display import (
    clock_time,
    human_bytes,
    human_count,
    human_duration,
    integer,
    short_bytes,
)
from dspark_cache.tui.tail import TAIL_WINDOW
from tests.support import tui_states
from tests.support.monitor import app_for, plain

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CHILD_TIMEOUT = 25.0  # a healthy child needs a few seconds; a hung one is killed
CHILD_MEMORY = 1 << 30  # address space of the child: a 1e9-element list would need 8 GB
MEMORY_BOUND = 40 << 20  # peak Python allocations while the monitor shows one hostile cache


# --- driving the app ---------------------------------------------------------------------------


def screen_text(app: MonitorApp) -> dict:
    """What the monitor shows, widget by widget, as plain text."""
    ranks = app.query_one("#ranks")
    warnings = app.query_one("#warnings")
    return {
        "header": plain(app.query_one("#header")),
        "warnings": plain(warnings) if warnings.display else "",
        "skipped": list(app.snapshot.warnings),
        "progress": plain(app.query_one("#progress-text")),
        "shards": plain(app.query_one("#shards")),
        "stages": plain(app.query_one("#stages")),
        "events": plain(app.query_one("#events")),
        "ranks": [[str(c) for c in ranks.get_row_at(i)] for i in range(ranks.row_count)],
        "columns": [str(c.label) for c in ranks.ordered_columns],
        "tokens": plain(app.query_one("#tok-label")),
    }


def cell(shown: dict, row: int, column: str) -> str:
    """One cell of the rank table as shown, by its column's name."""
    return shown["ranks"][row][shown["columns"].index(column)]


async def show(root: str, keys: str = "", then: Callable[[], None] | None = None) -> dict:
    """What the monitor shows for ``root``, after pressing ``keys``; ``notes`` are its notifications.

    ``then`` changes the files after the first scan (a next heartbeat, to measure a rate).
    """
    app = app_for(root)
    notes: list[str] = []
    notify = app.notify
    app.notify = lambda message, **kw: (notes.append(message), notify(message, **kw))[1]
    async with app.run_test(size=(160, 70)) as pilot:
        await app.first_snapshot()
        if then is not None:
            then()
            await app.refreshed()
        for key in keys:
            await pilot.press(key)
        await app.refreshed()
        return {**screen_text(app), "notes": notes}


def _child_main(argv: list[str]) -> None:
    """In the child: show each cache, with the peak of Python allocations while doing it."""
    import tracemalloc

    keys = argv.pop(0).removeprefix("--press=") if argv[0].startswith("--press=") else ""
    out = []
    for root in argv:
        tracemalloc.start()
        shown = asyncio.run(show(root, keys))
        shown["peak"] = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
        out.append(shown)
    print(json.dumps(out))


def _limit_memory() -> None:
    resource.setrlimit(resource.RLIMIT_AS, (CHILD_MEMORY, CHILD_MEMORY))


def watch_in_child(*roots: str, press: str = "") -> list[dict]:
    """Show each cache in a fresh process; a hang or a crash fails the test with what it printed."""
    code = "import sys; from tests.tui.test_tui_hostile import _child_main; _child_main(sys.argv[1:])"
    try:
        proc = subprocess.run([sys.executable, "-c", code, f"--press={press}", *roots], cwd=REPO,
                              capture_output=True, text=True, timeout=CHILD_TIMEOUT, preexec_fn=_limit_memory)
    except subprocess.TimeoutExpired:
        pytest.fail(f"the monitor hung: killed after {CHILD_TIMEOUT:.0f} s")
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.splitlines()[-1])


# --- hostile caches ----------------------------------------------------------------------------


def live(root) -> CachePaths:
    """The two-rank live run of the snapshot tests, as a base to damage."""
    return CachePaths(tui_states.live_run(str(root)))


def write_json(path: str, obj: dict) -> None:
    with open(path, "w") as handle:
        json.dump(obj, handle)


def status_dict(rank: int, **fields) -> dict:
    base = msgspec.to_builtins(tui_states.status(rank, 2, "running", 1.0, shard=20 + rank))
    return {**base, **fields}


def event_line(age: float, message: str, **fields) -> bytes:
    """One event log line, rank 0's warning unless ``fields`` say otherwise (any JSON value)."""
    event = {**msgspec.to_builtins(tui_states.event(0, age, "warning", message)), **fields}
    return json.dumps(event).encode() + b"\n"


def manifest_dict(**fields) -> dict:
    return {**msgspec.to_builtins(tui_states.manifest(60)), **fields}


# --- 1. hangs: FIFOs, devices, directories, symlinks out of the cache ----------------------------


def test_fifos_directories_and_outside_symlinks_are_skipped_with_a_warning(tmp_path):
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "events.jsonl").write_bytes(event_line(1, "OUTSIDE EVENT"))
    write_json(str(outside / "status.json"), status_dict(7))
    # reached only through a status/ symlinked out of the cache
    os.mkfifo(outside / os.path.basename(CachePaths(str(tmp_path)).status(0)))

    junk = live(tmp_path / "junk")
    os.remove(junk.events(1))
    os.mkfifo(junk.events(1))
    os.mkfifo(junk.status(2))
    os.mkdir(junk.status(3))
    os.symlink(outside / "events.jsonl", junk.events(4))
    os.symlink(outside / "status.json", junk.status(5))
    os.mkfifo(junk.shard_index(30))
    os.symlink(outside / "status.json", junk.shard_index(31))  # any file out of the cache: not followed
    os.symlink(junk.events(0), junk.events(6))  # inside the cache: followed

    fifo_manifest = live(tmp_path / "fifo-manifest")
    os.remove(fifo_manifest.manifest)
    os.mkfifo(fifo_manifest.manifest)

    status_elsewhere = live(tmp_path / "status-elsewhere")
    for name in os.listdir(status_elsewhere.status_dir):
        os.remove(os.path.join(status_elsewhere.status_dir, name))
    os.rmdir(status_elsewhere.status_dir)
    os.symlink(outside, status_elsewhere.status_dir)

    junk_shown, manifest_shown, elsewhere_shown = watch_in_child(
        junk.root, fifo_manifest.root, status_elsewhere.root)

    skipped = "\n".join(junk_shown["skipped"])
    for expected in ("events/rank-00001.jsonl: a FIFO", "status/rank-00002.json: a FIFO",
                     "status/rank-00003.json: a directory", "events/rank-00004.jsonl: a symlink to outside",
                     "status/rank-00005.json: a symlink to outside", "shards/shard-000030.idx: a FIFO",
                     "shards/shard-000031.idx: a symlink to outside"):
        assert expected in skipped
    assert "⚠" in junk_shown["warnings"] and "2 more skipped" in junk_shown["warnings"]
    assert [row[0] for row in junk_shown["ranks"]] == ["0", "1"]
    assert "OUTSIDE EVENT" not in junk_shown["events"] and "shard 19 published" in junk_shown["events"]
    assert "22 published" in junk_shown["shards"]

    assert "cannot show this cache" in manifest_shown["header"] and "a FIFO" in manifest_shown["header"]
    assert "status/: a symlink to outside the cache" in elsewhere_shown["warnings"]
    assert elsewhere_shown["ranks"] == []


def test_stop_request_never_writes_into_a_fifo_or_out_of_the_cache(tmp_path):
    fifo = live(tmp_path / "fifo")
    os.mkdir(os.path.dirname(fifo.stop_request))
    os.mkfifo(fifo.stop_request)  # nobody reads it: a blocking open for writing never returns
    elsewhere = live(tmp_path / "elsewhere")
    (tmp_path / "outside").mkdir()
    os.symlink(tmp_path / "outside", os.path.dirname(elsewhere.stop_request))

    fifo_shown, elsewhere_shown = watch_in_child(fifo.root, elsewhere.root, press="s")

    assert fifo_shown["notes"] == ["could not ask the producer to stop: stop is a FIFO, not a regular file"]
    assert elsewhere_shown["notes"] == ["could not ask the producer to stop: a symlink to outside the cache, "
                                        "not followed"]
    assert os.listdir(tmp_path / "outside") == []


# --- 2. memory: huge logs, a billion planned shards, huge status files ---------------------------


def test_huge_event_log_and_billion_shard_plan_stay_bounded(tmp_path):
    huge_log = live(tmp_path / "log")
    filler = event_line(100, "old filler event " + "x" * 40)
    with open(huge_log.events(0), "wb") as handle:
        for _ in range(50 * 1024 * 1024 // (len(filler) * 1000)):
            handle.write(filler * 1000)
        handle.write(event_line(1, "the newest event") + b'{"time": 1, "half a li')

    billion = live(tmp_path / "billion")
    write_json(
        billion.manifest, manifest_dict(num_shards=10**9, planned_samples=10**10, planned_tokens=10**13)
    )

    log_shown, billion_shown = watch_in_child(huge_log.root, billion.root)

    assert "the newest event" in log_shown["events"] and "half a li" not in log_shown["events"]
    assert log_shown["peak"] < MEMORY_BOUND, f"{log_shown['peak'] / 2**20:.0f} MiB for a 50 MB event log"
    shards = billion_shown["shards"]
    assert ("22 published  1 writing  1 abandoned (rerun resumes)  999999975 pending  1 failed  "
            "(one cell = 1250000 shards)") in shards
    assert len(shards.splitlines()[-1]) <= 800
    assert "shards 22/1000000000" in billion_shown["progress"]
    # shown, and flagged
    assert "manifest.json: num_shards 1000000000 is not in [0, " in billion_shown["warnings"]
    assert billion_shown["peak"] < MEMORY_BOUND, f"{billion_shown['peak'] / 2**20:.0f} MiB for 1e9 shards"


@pytest.mark.anyio
async def test_event_log_is_read_from_a_bounded_tail_as_it_grows(tmp_path):
    paths = live(tmp_path / "c")
    line = event_line(100, "filler")
    with open(paths.events(0), "wb") as handle:  # newest first: shown if the whole log were read
        handle.write(event_line(0, "written first, timed last") + line * (4 * TAIL_WINDOW // len(line)))
    app = app_for(paths.root)
    async with app.run_test(size=(160, 70)):
        await app.first_snapshot()
        assert "filler" in plain(app.query_one("#events"))
        assert "written first, timed last" not in plain(app.query_one("#events"))  # beyond the window
        with open(paths.events(0), "ab") as handle:
            handle.write(event_line(-1, "appended while watching"))
        await app.refreshed()
        assert "appended while watching" in plain(app.query_one("#events"))


@pytest.mark.anyio
async def test_oversized_status_file_is_refused_not_read(tmp_path):
    paths = live(tmp_path / "c")
    with open(paths.status(1), "w") as handle:  # valid JSON, padded past the 1 MiB cap
        handle.write(json.dumps(status_dict(1)) + " " * (2 << 20))
    shown = await show(paths.root)
    assert "status/rank-00001.json: unreadable status, too large (2.1 MB" in shown["warnings"]
    assert [row[0] for row in shown["ranks"]] == ["0"]


# --- 3. crashes: names and numbers ---------------------------------------------------------------


@pytest.mark.anyio
async def test_partial_files_with_foreign_names_are_ignored(tmp_path):
    paths = live(tmp_path / "c")
    for name in ("shard-abcdef.tar.partial", "shard-00002x.tar.partial", "shard-1.tar.partial",
                 "xshard-000030.tar.partial", "shard-٣٣٣٣٣٣.tar.partial", "shard-000031.tar.partial.tmp"):
        open(os.path.join(paths.shards_dir, name), "wb").close()
    shown = await show(paths.root)
    assert "22 published  1 writing  1 abandoned (rerun resumes)  35 pending  1 failed" in shown["shards"]


@pytest.mark.anyio
async def test_event_times_out_of_range_show_a_question_mark(tmp_path):
    paths = live(tmp_path / "c")
    with open(paths.events(0), "ab") as handle:
        handle.write(event_line(0, "from the far future", time=1e300))
        handle.write(event_line(0, "from before time", time=-1e300))
        handle.write(event_line(0, "huge rank, bad shard id", kind="error", shard=[1], rank=10**30))
    shown = await show(paths.root)
    lines = shown["events"].splitlines()
    assert any(line.startswith("? r0 warning") and "far future" in line for line in lines)
    assert any(line.startswith("? r0 warning") and "before time" in line for line in lines)
    assert any("r>999T" in line and "bad shard id" in line for line in lines)
    assert "1 failed" in shown["shards"]  # only the real failure from live_run


@pytest.mark.anyio
async def test_stage_seconds_that_sum_to_infinity(tmp_path):
    paths = live(tmp_path / "c")
    for rank in (0, 1):
        write_json(paths.status(rank), status_dict(rank, stage_seconds={"device": 1.7e308, "data": -2.0,
                                                                           "copy": 5e-324, "write": 3e7}))
    shown = await show(paths.root)
    stages = {line.split()[0]: line for line in shown["stages"].splitlines()}
    assert stages["device"].endswith("█" * 24 + "          ∞")
    assert stages["data"].endswith(" —") and "█" not in stages["data"]
    assert stages["copy"].endswith(" 0.0 s")
    assert stages["write"].endswith("█" * 24 + "    694d10h")


@pytest.mark.anyio
async def test_vanishing_rate_gives_an_infinite_eta(tmp_path):
    paths = live(tmp_path / "c")
    write_json(paths.status(0), status_dict(0, tokens_done=1, updated_at=tui_states.NOW - 1))
    # one token more, a lifetime of floats later: a rate of 6e-309 tokens/s
    shown = await show(paths.root, then=lambda: write_json(
        paths.status(0), status_dict(0, tokens_done=2, updated_at=1.7e308)))
    assert "0 tok/s  ETA ∞" in shown["progress"]


@pytest.mark.anyio
async def test_counts_that_jump_shrink_or_overflow_give_placeholders_not_rates(tmp_path):
    paths = live(tmp_path / "c")
    write_json(
        paths.status(0), status_dict(0, tokens_done=1, bytes_written=10, updated_at=tui_states.NOW - 9)
    )
    write_json(paths.status(1), status_dict(1, tokens_done=10**9, updated_at=tui_states.NOW - 9))

    def next_heartbeats() -> None:
        write_json(paths.status(0), status_dict(0, tokens_done=10**400, bytes_written=10**400,
                                                updated_at=tui_states.NOW - 1))
        write_json(paths.status(1), status_dict(1, tokens_done=5, updated_at=tui_states.NOW - 1))  # went down

    shown = await show(paths.root, then=next_heartbeats)
    assert cell(shown, 0, "tok/s") == "∞" and cell(shown, 1, "tok/s") == "-"
    assert shown["tokens"].startswith("tokens/s now ∞") and "ETA 0m00s" in shown["progress"]


@pytest.mark.anyio
async def test_negative_and_huge_numbers_show_placeholders(tmp_path):
    paths = live(tmp_path / "c")
    write_json(paths.status(0), status_dict(0, samples_done=-3, inflight_bytes=-1, tokens_per_s=-5.0,
                                            shards_done=-1, pid=10**30, updated_at=tui_states.NOW + 60,
                                            weight_bytes=-1, device_memory_bytes=10**30,
                                            writing=[-2, 10**30, 7, 8]))
    write_json(paths.status(1), status_dict(1, state="finished", updated_at=-1.7e308, shard=-4,
                                            weight_bytes=10**400, device_memory_bytes=None))
    write_json(paths.manifest, manifest_dict(planned_tokens=10**400, planned_samples=-1, num_shards=-5,
                                             created_at=-1.7e308))
    shown = await show(paths.root)
    assert cell(shown, 0, "host/pid") == "node-a/>999T" and cell(shown, 0, "run shards") == "—/10"
    assert cell(shown, 0, "shard") == "—,>999T,7 +1"  # shards in flight: three shown, then how many more
    assert cell(shown, 0, "tok/s") == "-"  # one heartbeat gives no rate, whatever its rate field claims
    assert cell(shown, 0, "inflight") == "—"
    assert cell(shown, 0, "weights") == "—" and cell(shown, 0, "device mem") == ">999 PB"
    assert cell(shown, 1, "weights") == "∞" and cell(shown, 1, "device mem") == "-"  # not measured
    assert cell(shown, 0, "heartbeat") == "— ago"  # a heartbeat from the future: no age to show
    assert cell(shown, 1, "shard") == "—" and cell(shown, 1, "heartbeat") == ">999d ago"
    assert "samples 220/—" in shown["progress"] and "/∞" in shown["progress"] and "/—" in shown["progress"]
    assert shown["shards"] == "no shards planned yet"


@pytest.mark.anyio
async def test_markup_and_dollars_in_file_strings_are_shown_literally(tmp_path):
    paths = live(tmp_path / "c")
    write_json(paths.manifest, manifest_dict(target_model="[/]evil [b]$model", train_data_path="x\\"))
    write_json(paths.status(0), status_dict(0, host="[/][red]", state="[@click=app.quit]", last_error="[/b]"))
    with open(paths.events(0), "ab") as handle:
        handle.write(event_line(0, "message [/] with $dollar"))
    shown = await show(paths.root)
    assert shown["header"].startswith("[/]evil [b]$model (qwen3") and "input: x\\" in shown["header"]
    assert cell(shown, 0, "host/pid") == "[/][red]/1000" and cell(shown, 0, "last error") == "[/b]"
    assert "message [/] with $dollar" in shown["events"]


# --- 4. corrupt or foreign manifests -------------------------------------------------------------


NEMO_MANIFEST = json.dumps(
    {
        k: v
        for k, v in manifest_dict(format_version=1).items()
        if k in ("format_version", "target_model", "hidden_size", "num_samples", "dtype")
    }
)


@pytest.mark.anyio
@pytest.mark.parametrize("content, says", [
    (NEMO_MANIFEST.encode(), "a NeMo Automodel cache"),
    (b"\x00\xff{ not json", "not a valid dspark-cache manifest"),
    (b"[1, 2, 3]", "not a valid dspark-cache manifest"),
    (json.dumps(manifest_dict(format_version="[/]")).encode(), "format_version '[/]' is not"),
    (json.dumps(manifest_dict(num_shards="many")).encode(), "Expected `int`, got `str`"),
], ids=["nemo", "garbage", "list", "markup-version", "wrong-type"])
async def test_foreign_or_corrupt_manifest_is_a_clear_message(tmp_path, content, says):
    paths = live(tmp_path / "c")
    with open(paths.manifest, "wb") as handle:
        handle.write(content)
    shown = await show(paths.root)
    assert "cannot show this cache:" in shown["header"] and says in shown["header"]
    assert "Waiting for dspark-produce" not in shown["header"]
    assert shown["progress"] == "no plan yet"


# --- the formatters themselves -------------------------------------------------------------------


def test_formatters_never_raise_and_use_placeholders():
    nan, inf = math.nan, math.inf
    assert [human_duration(x) for x in (nan, inf, -1, 1e300, 10**400, 65)] == [
        "?", "∞", "—", ">999d", "∞", "1m05s"]
    assert [human_count(x) for x in (nan, inf, -inf, -1, 5e-324, 1e300, 10**400, 20_000)] == [
        "?", "∞", "—", "—", "0", ">999T", "∞", "20.0k"]
    assert [human_bytes(x) for x in (nan, inf, -1, 1e300, 10**400, 512, 40e6)] == [
        "?", "∞", "—", ">999 PB", "∞", "512 B", "40.0 MB"]
    assert [short_bytes(x) for x in (nan, inf, -1, 1e300, 10**400, 512, 1_100_000_000)] == [
        "?", "∞", "—", ">999P", "∞", "512B", "1.1G"]
    assert [integer(x) for x in (-1, -(10**4000), 10**4000, 42)] == ["—", "—", "∞", "42"]
    assert [human_count(x) for x in (-(10**400), 10**16)] == ["—", ">999T"]
    assert [clock_time(x) for x in (nan, inf, -1.0, 1e300, 1e18, 0.0)] == [
        "?",
        "?",
        "?",
        "?",
        "?",
        "00:00:00",
    ]
