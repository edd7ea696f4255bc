"""Overall progress: samples, real tokens and shards, with rate and ETA (or the final summary)."""

from __future__ import annotations

from textual.app import ComposeResult
from textual.containers import Vertical
from textual.widgets import ProgressBar

from dspark_cache.format.schema import Manifest
from dspark_cache.tui.display import as_float, human_bytes, human_count, human_duration, integer
from dspark_cache.tui.fit import Para, piece, words
from dspark_cache.tui.snapshot import Snapshot
from dspark_cache.tui.widgets import SHOWS_SNAPSHOT
from dspark_cache.tui.widgets.fitted import Fitted


class OverallProgress(Vertical):
    """Samples, tokens and shards done of the plan, with a bar of the tokens; the summary once complete."""

    DEFAULT_CLASSES = SHOWS_SNAPSHOT
    DEFAULT_CSS = """
    OverallProgress { height: auto; border: round $primary; padding: 0 1; }
    OverallProgress ProgressBar { width: 100%; }
    """

    def compose(self) -> ComposeResult:
        yield Fitted(id="progress-text")
        yield ProgressBar(total=1, show_eta=False, id="progress-bar")

    def show(self, snap: Snapshot) -> None:
        m = snap.manifest
        bar = self.query_one("#progress-bar", ProgressBar)
        if m is None:
            bar.update(total=1, progress=0)
        else:
            bar.update(**bar_position(snap.tokens_done, m.planned_tokens))
        self.query_one("#progress-text", Fitted).show_paras([progress(snap)])


def progress(snap: Snapshot) -> Para:
    """Where the cache stands: the plan's progress while running, the summary once complete."""
    m = snap.manifest
    if m is None:
        return Para([piece("no plan yet")])
    return summary(m, snap) if snap.complete else running(m, snap)


def bar_position(done: int, planned: int) -> dict[str, float]:
    """Total and progress for the bar, both finite and in order whatever the files claim."""
    total = as_float(planned)
    total = total if total is not None and 1 <= total < float("inf") else 1.0
    progress = as_float(done)
    progress = min(max(progress, 0.0), total) if progress is not None else 0.0
    return {"total": total, "progress": progress}


def summary(m: Manifest, snap: Snapshot) -> Para:
    """The line of a complete cache."""
    elapsed = (m.completed_at or snap.now) - m.created_at if m.created_at else None
    return Para(
        [
            piece("complete:", "bold green"),
            *words(
                "$samples, $tokens, $shards, $bytes ($ratio) in $elapsed; $skipped, $nonfinite",
                samples=f"{integer(m.num_samples)} samples",
                tokens=f"{human_count(m.planned_tokens)} tokens",
                shards=f"{integer(m.num_shards)} shards",
                bytes=human_bytes(snap.bytes_done),
                ratio=f"{bytes_per_token(snap.bytes_done, m.planned_tokens)} B/token",
                elapsed=human_duration(elapsed),
                skipped=f"{integer(len(m.skipped))} rows skipped",
                nonfinite=f"{integer(len(m.nonfinite_samples))} non-finite",
            ),
        ],
        " ",
    )


def bytes_per_token(written: int, tokens: int) -> str:
    """Whole bytes per planned token (a plan of no tokens counts as one)."""
    ratio = as_float(written)
    ratio = ratio / max(as_float(tokens) or 1.0, 1.0) if ratio is not None else None
    return integer(round(ratio)) if ratio is not None and 0 <= ratio < 1e15 else human_count(ratio)


def running(m: Manifest, snap: Snapshot) -> Para:
    """Where a run stands: done out of planned, the live run's rate and the time left."""
    done = [piece(f"samples {integer(snap.samples_done)}/{integer(m.planned_samples)}"),
            piece(f"tokens {human_count(snap.tokens_done)}/{human_count(m.planned_tokens)}"),
            piece(f"shards {integer(len(snap.published))}/{integer(m.num_shards)}")]
    if not snap.live_ranks:
        return Para([*done, piece("no producer running", "yellow")])
    rate = snap.tokens_per_s
    if rate is None:  # a second heartbeat is needed to measure the live run's own work
        return Para([*done, piece("tok/s measuring…"), piece("ETA ?")])
    return Para(
        [*done, piece(f"{human_count(rate)} tok/s"), piece(f"ETA {human_duration(snap.eta_seconds())}")]
    )
