"""One widget per file, each rendering a part of a :class:`~dspark_cache.tui.watcher.Snapshot`."""
