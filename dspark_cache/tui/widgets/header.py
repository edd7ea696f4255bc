"""Run identity: target, layers, dtype, sequence length, output dir, world size."""

from __future__ import annotations

from rich.text import Text

from dspark_cache.format.schema import Manifest
from dspark_cache.tui.display import clip, integer
from dspark_cache.tui.fit import Para, piece, words
from dspark_cache.tui.snapshot import Snapshot
from dspark_cache.tui.widgets import SHOWS_SNAPSHOT
from dspark_cache.tui.widgets.fitted import Fitted

MAX_LAYER_IDS = 16  # a manifest may list any number; the header stays one line


class RunHeader(Fitted):
    """Who the run is for, from the manifest; or why the directory cannot be shown."""

    DEFAULT_CLASSES = SHOWS_SNAPSHOT
    DEFAULT_CSS = "RunHeader { height: auto; padding: 0 1; background: $boost; }"

    def show(self, snap: Snapshot) -> None:
        self.show_paras(header(snap))


def header(snap: Snapshot) -> list[Para]:
    """The header's lines: the identity of a readable cache, or why there is none to show."""
    path = clip(snap.path, 300)
    where = piece(f"{path} (object storage):" if snap.remote else f"{path}:", "bold")
    if not snap.exists:  # dspark-monitor waits for it (--no-wait exits instead)
        return [Para([where, *words("does not exist yet; waiting for it to appear (start dspark-produce "
                                    "--output-dir $path)", "yellow", path=path)], " ")]
    if snap.manifest_error:
        # A manifest is there but is not ours (a NeMo cache, an older format) or is damaged:
        # say so plainly rather than pretending to wait for a producer.
        return [Para([where, *words("cannot show this cache:", "bold red"),
                      *words(clip(snap.manifest_error, 600))], " ")]
    if snap.manifest is None:
        return [
            Para(
                [
                    where,
                    *words(
                        "not a dspark cache yet (no manifest.json yet). Waiting for dspark-produce "
                        "to plan; start it with --output-dir pointing here.",
                        "yellow",
                    ),
                ],
                " ",
            )
        ]
    return identity(snap.manifest, snap)


def identity(m: Manifest, snap: Snapshot) -> list[Para]:
    """The header lines of a readable cache: the target, then where the cache and its input are."""
    world = max((r.world_size for r in snap.ranks), default=0)
    return [
        Para([Text.assemble((clip(m.target_model, 200), "bold"), f" ({clip(m.target_model_type, 40)}, "
                            f"{integer(m.num_hidden_layers)} layers, H={integer(m.hidden_size)})"),
              piece(f"layers {layer_ids(m)}"),
              piece(f"{clip(m.dtype, 20)} cache / {clip(m.compute_dtype, 20)} compute"),
              piece(f"seq {integer(m.seq_length)}")]),
        Para([piece(f"{snap.path} (object storage)" if snap.remote else snap.path),
              piece(f"ranks: {integer(world) if world > 0 else '-'}"),
              # a long path is shortened in its middle: keeps its name
              piece(f"input: {m.train_data_path}")]),
    ]


def layer_ids(m: Manifest) -> str:
    """``[1, 10, 18]`` as the manifest lists them, shortened when there are many."""
    ids = [integer(i) for i in m.target_layer_ids[:MAX_LAYER_IDS]]
    more = ", …" if len(m.target_layer_ids) > MAX_LAYER_IDS else ""
    return "[" + ", ".join(ids) + more + "]"
