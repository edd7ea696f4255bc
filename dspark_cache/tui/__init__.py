"""``dspark-monitor``: a Textual app over a cache directory (reads files only; never imports torch)."""
