"""``dspark-monitor``: a Textual view of a cache directory (reads files only; never imports torch)."""
