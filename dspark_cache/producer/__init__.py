"""``dspark-produce``: chat rows -> target forward -> compact WebDataset shards.

The stages follow the data, one sub-package each (its ``__init__`` names what the others use):
``inputs`` (``--input-data`` as rows) -> ``encode`` (rows to samples: chat template, loss mask)
-> ``plan`` (batches and shards with exact bytes, saved, made once per job) -> ``device`` (the
target, ranks, the compute loop) -> ``pipeline`` (host ring, writer thread) -> the cache;
``report`` (heartbeats, events, progress, stop requests) runs alongside. At the top: ``config``,
``prepare``, ``resume``, ``run``, ``finish``, ``exchange`` (how the job's ranks read each other's
files), ``hub`` (the hub asked once) and the torchrun entry (``__main__``).

The public API, for tools such as ``bench/`` and ``dspark-convert`` (everything else in this
package is internal and may change with the producer):

* ``ProduceConfig``: every setting, by the command line's option names (``config``).
* ``load_tokenizer(cfg, template=None)``, ``plan_input(cfg, encoder, source, shape)``: the
  tokenizer and the plan exactly as ``dspark-produce`` makes them (``prepare``); a sample's
  shape is ``dspark_cache.format.geometry.SampleShape``.
* ``ChatEncoder`` (``encode.chat``), ``InputSource`` (``inputs.source``); what it yields, ``RawRow``,
  ``InvalidRow``, ``InputError`` (``inputs.rows``), and ``normalise_row`` (``encode.messages``): a row
  as the producer reads it (``dspark-regenerate`` reads its input through these).
* ``counter``, ``set_progress``: the progress bars and their log lines (``report.progress``).
* ``read_target_info``, ``resolve_device``, ``TargetRunner``: the target (``device.target``).
* ``run_pipeline``, ``collate``, ``finite_flags``: the device-to-writer pipeline (``pipeline.loop``).
* ``torch_dtype``, ``dtype_code``, ``byte_views``: torch dtypes of the format's codes and back,
  tensors as writer bytes (``pipeline.tensors``).
* ``produce(cfg)``: one rank's whole run (``run``); the command line is ``dspark_cache.cli``, the
  torchrun entry ``python -m dspark_cache.producer``.

Names are imported on first use, so ``import dspark_cache.producer`` costs nothing.
"""

from __future__ import annotations

import importlib
from typing import Any

_API = {
    "ProduceConfig": "config",
    "load_tokenizer": "prepare",
    "plan_input": "prepare",
    "ChatEncoder": "encode.chat",
    "InputSource": "inputs.source",
    "RawRow": "inputs.rows",
    "InvalidRow": "inputs.rows",
    "InputError": "inputs.rows",
    "normalise_row": "encode.messages",
    "counter": "report.progress",
    "set_progress": "report.progress",
    "read_target_info": "device.target",
    "resolve_device": "device.target",
    "TargetRunner": "device.target",
    "run_pipeline": "pipeline.loop",
    "collate": "pipeline.loop",
    "finite_flags": "pipeline.loop",
    "torch_dtype": "pipeline.tensors",
    "dtype_code": "pipeline.tensors",
    "byte_views": "pipeline.tensors",
    "produce": "run",
}

__all__ = list(_API)


def __getattr__(name: str) -> Any:
    module = _API.get(name)
    if module is None:
        raise AttributeError(f"module 'dspark_cache.producer' has no attribute {name!r}")
    return getattr(importlib.import_module(f"dspark_cache.producer.{module}"), name)
