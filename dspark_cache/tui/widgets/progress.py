"""Overall progress: samples, real tokens and shards, with rate and ETA (or the final summary)."""

from __future__ import annotations

from textual.app import ComposeResult
from textual.containers import Vertical
from textual.widgets import ProgressBar, Static

from dspark_cache.tui.format import human_bytes, human_count, human_duration
from dspark_cache.tui.watcher import Snapshot


class OverallProgress(Vertical):
    DEFAULT_CSS = """
    OverallProgress { height: auto; border: round $primary; padding: 0 1; }
    OverallProgress ProgressBar { width: 100%; }
    """

    def compose(self) -> ComposeResult:
        yield Static(id="progress-text")
        yield ProgressBar(total=1, show_eta=False, id="progress-bar")

    def show(self, snap: Snapshot) -> None:
        m = snap.manifest
        text = self.query_one("#progress-text", Static)
        bar = self.query_one("#progress-bar", ProgressBar)
        if m is None:
            text.update("no plan yet")
            bar.update(total=1, progress=0)
            return
        tokens = snap.tokens_done
        bar.update(total=max(m.planned_tokens, 1), progress=min(tokens, m.planned_tokens))
        if snap.complete:
            elapsed = (m.completed_at or snap.now) - m.created_at if m.created_at else None
            text.update(
                f"[b green]complete[/]: {m.num_samples} samples, {human_count(m.planned_tokens)} tokens, "
                f"{m.num_shards} shards, {human_bytes(snap.bytes_done)} "
                f"({snap.bytes_done / max(m.planned_tokens, 1):.0f} B/token) in {human_duration(elapsed)}; "
                f"{len(m.skipped)} rows skipped, {len(m.nonfinite_samples)} non-finite"
            )
            return
        rate = snap.tokens_per_s
        text.update(
            f"samples {snap.samples_done}/{m.planned_samples}   tokens {human_count(tokens)}/{human_count(m.planned_tokens)}"
            f"   shards {len(snap.published)}/{m.num_shards}   "
            f"{human_count(rate)} tok/s   ETA {human_duration(snap.eta_seconds()) if rate else '?'}"
        )
