"""Run identity: target, layers, dtype, sequence length, output dir, world size."""

from __future__ import annotations

from textual.widgets import Static

from dspark_cache.tui.watcher import Snapshot


class RunHeader(Static):
    DEFAULT_CSS = "RunHeader { height: auto; padding: 0 1; background: $boost; }"

    def show(self, snap: Snapshot) -> None:
        m = snap.manifest
        if not snap.exists:
            self.update(f"[b red]{snap.path} does not exist[/]")
        elif m is None:
            why = snap.manifest_error or "no manifest.json yet"
            self.update(f"[b]{snap.path}[/]: [yellow]not a dspark cache yet ({why}). Waiting for dspark-produce "
                        "to plan; start it with --output-dir pointing here.[/]")
        else:
            world = max((r.world_size for r in snap.ranks), default=0)
            self.update(
                f"[b]{m.target_model}[/] ({m.target_model_type}, {m.num_hidden_layers} layers, H={m.hidden_size})  "
                f"layers {m.target_layer_ids}  {m.dtype} cache / {m.compute_dtype} compute  seq {m.seq_length}\n"
                f"{snap.path}  ranks: {world or '-'}  input: {m.train_data_path}"
            )
