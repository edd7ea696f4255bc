"""The on-disk contract (format v1) that producer, loader and TUI all import.

This package imports neither torch nor transformers at module level except in the tensor
codec (``sample``) and the shard reader/writer, so the TUI can use ``schema`` and ``paths``
cheaply.
"""
