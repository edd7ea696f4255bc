"""The on-disk contract (format v1) that producer, loader and TUI all import.

This package never imports torch or transformers (numpy at most): dtypes are safetensors codes,
the shard writer takes buffers and decoding gives numpy views, so the monitor and
``dspark-verify`` use it cheaply. Torch tensors are made by the loader (``loader/tensors.py``)
and the producer (``producer/pipeline/tensors.py``).
"""
