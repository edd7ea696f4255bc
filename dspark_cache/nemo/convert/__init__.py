"""Convert DSpark target caches between NeMo Automodel's padded safetensors format and ours.

* :func:`convert_to_dspark` imports a complete NeMo cache (padding stripped, the duplicated
  final state stored once, sample and shard numbering kept).
* :func:`convert_to_nemo` exports a dspark cache in NeMo 0.7.0's exact format and manifest.

Both stream one row at a time, publish shards atomically and resume after a crash; the
``dspark-convert`` command (:mod:`.cli`) wraps them.
"""

from __future__ import annotations

from dspark_cache.nemo.convert.common import ConvertError, ConvertResult, ConvertUsageError
from dspark_cache.nemo.convert.to_dspark import convert_to_dspark
from dspark_cache.nemo.convert.to_nemo import convert_to_nemo

__all__ = ["ConvertError", "ConvertResult", "ConvertUsageError", "convert_to_dspark", "convert_to_nemo"]
