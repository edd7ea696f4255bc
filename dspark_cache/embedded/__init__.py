"""The embedded default: a tiny offline target and sample chat data (demo, tests, bench)."""
