"""Run identity: target, layers, dtype, sequence length, output dir, world size."""

from __future__ import annotations

from textual.content import Content
from textual.widgets import Static

from dspark_cache.format.schema import Manifest
from dspark_cache.tui.display import clip, integer, markup
from dspark_cache.tui.snapshot import Snapshot
from dspark_cache.tui.widgets import VIEW

MAX_LAYER_IDS = 16  # a manifest may list any number; the header stays one line


class RunHeader(Static):
    """Who the run is for, from the manifest; or why the directory cannot be shown."""

    DEFAULT_CLASSES = VIEW
    DEFAULT_CSS = "RunHeader { height: auto; padding: 0 1; background: $boost; }"

    def show(self, snap: Snapshot) -> None:
        m = snap.manifest
        path = clip(snap.path, 300)
        if not snap.exists:  # dspark-monitor waits for it (--no-wait exits instead)
            self.update(markup("[b]$path[/]: [yellow]does not exist yet; waiting for it to appear (start "
                               "dspark-produce --output-dir $path)[/]", path=path))
        elif snap.manifest_error:
            # A manifest is there but is not ours (a NeMo cache, an older format) or is damaged:
            # say so plainly rather than pretending to wait for a producer.
            self.update(markup("[b]$path[/]: [b red]cannot show this cache:[/] $why", path=path,
                               why=clip(snap.manifest_error, 600)))
        elif m is None:
            self.update(markup("[b]$path[/]: [yellow]not a dspark cache yet (no manifest.json yet). Waiting for "
                               "dspark-produce to plan; start it with --output-dir pointing here.[/]", path=path))
        else:
            self.update(identity(m, snap, path))


def identity(m: Manifest, snap: Snapshot, path: str) -> Content:
    """The two header lines of a readable cache."""
    world = max((r.world_size for r in snap.ranks), default=0)
    return markup(
        "[b]$model[/] ($kind, $layers layers, H=$hidden)  layers $ids  $dtype cache / $compute compute  "
        "seq $seq\n$path  ranks: $world  input: $data",
        model=clip(m.target_model, 200), kind=clip(m.target_model_type, 40), layers=integer(m.num_hidden_layers),
        hidden=integer(m.hidden_size), ids=layer_ids(m), dtype=clip(m.dtype, 20), compute=clip(m.compute_dtype, 20),
        seq=integer(m.seq_length), path=path, world=integer(world) if world > 0 else "-",
        data=clip(m.train_data_path, 200),
    )


def layer_ids(m: Manifest) -> str:
    """``[1, 10, 18]`` as the manifest lists them, shortened when there are many."""
    ids = [integer(i) for i in m.target_layer_ids[:MAX_LAYER_IDS]]
    more = ", …" if len(m.target_layer_ids) > MAX_LAYER_IDS else ""
    return "[" + ", ".join(ids) + more + "]"
