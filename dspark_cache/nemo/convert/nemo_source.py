"""A NeMo-layout cache opened for import: manifest and shard set checked, shards opened lazily.

Everything is checked before anything is written: a partial cache (``complete`` false, shards
missing) is refused, and every shard's tensors must have the names, dtypes and shapes its
manifest implies (NeMo's own reader checks none of this; a bad shard would surface mid-training).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Any

import torch

from dspark_cache.format.layers import validate_target_layer_ids
from dspark_cache.nemo import layout
from dspark_cache.nemo.convert.common import ConvertError
from dspark_cache.nemo.convert.stfile import SafetensorsFile

_INT_FIELDS = ("target_vocab_size", "hidden_size", "num_hidden_layers", "seq_length", "num_samples", "shard_size",
               "target_hidden_dim", "target_last_hidden_dim", "shuffle_seed")
_STR_FIELDS = ("target_model", "target_model_type", "dtype", "train_data_path", "chat_template_sha256")


@dataclass(frozen=True)
class NemoSource:
    """A complete NeMo cache whose manifest fields are known to be consistent."""

    root: str
    manifest: dict[str, Any]

    def _int(self, name: str) -> int:
        return int(self.manifest[name])

    @property
    def seq_length(self) -> int:
        return self._int("seq_length")

    @property
    def shard_size(self) -> int:
        return self._int("shard_size")

    @property
    def num_samples(self) -> int:
        return self._int("num_samples")

    @property
    def hidden_size(self) -> int:
        return self._int("hidden_size")

    @property
    def hidden_dim(self) -> int:
        return self._int("target_hidden_dim")

    @property
    def layer_ids(self) -> list[int]:
        return list(self.manifest["target_layer_ids"])

    @property
    def num_layers(self) -> int:
        return self._int("num_hidden_layers")

    @property
    def dtype(self) -> torch.dtype:
        return layout.DTYPES[self.manifest["dtype"]]

    @property
    def num_shards(self) -> int:
        return -(-self.num_samples // self.shard_size)

    @property
    def manifest_path(self) -> str:
        return layout.manifest_path(self.root)

    def shard_file(self, shard: int) -> str:
        return layout.shard_path(self.root, shard)

    def rows(self, shard: int) -> range:
        """Sample ids (= NeMo indices) held by ``shard``."""
        return range(shard * self.shard_size, min(self.num_samples, (shard + 1) * self.shard_size))

    def shard_bytes(self) -> int:
        return sum(os.path.getsize(self.shard_file(k)) for k in range(self.num_shards))

    def open_shard(self, shard: int) -> SafetensorsFile:
        """Open a shard and check its four tensors against the manifest."""
        handle = SafetensorsFile(self.shard_file(shard))
        try:
            n, seq = len(self.rows(shard)), self.seq_length
            expected = {
                "input_ids": (torch.int64, (n, seq)),
                "loss_mask": (torch.int64, (n, seq)),
                "target_hidden_states": (self.dtype, (n, seq, self.hidden_dim)),
                "target_last_hidden_states": (self.dtype, (n, seq, self.hidden_size)),
            }
            for key, (dtype, shape) in expected.items():
                got = handle.tensors.get(key)
                if got is None:
                    raise ConvertError(f"{handle.path}: no {key} tensor; a NeMo DSpark shard holds "
                                       f"{', '.join(layout.CACHE_KEYS)}")
                if got.dtype != dtype or got.shape != shape:
                    raise ConvertError(f"{handle.path}: {key} is {got.dtype} {list(got.shape)}, but "
                                       f"{self.manifest_path} implies {dtype} {list(shape)} for shard {shard}")
        except BaseException:
            handle.close()
            raise
        return handle


def _check_fields(path: str, manifest: dict[str, Any]) -> None:
    for name in _INT_FIELDS:
        value = manifest.get(name)
        if not isinstance(value, int) or isinstance(value, bool):
            raise ConvertError(f"{path}: field {name} must be an integer, found {value!r}")
    for name in _STR_FIELDS:
        if not isinstance(manifest.get(name), str):
            raise ConvertError(f"{path}: field {name} must be a string, found {manifest.get(name)!r}")
    if manifest.get("train_split") is not None and not isinstance(manifest["train_split"], str):
        raise ConvertError(f"{path}: field train_split must be a string or null, found {manifest['train_split']!r}")
    if manifest["dtype"] not in layout.DTYPES:
        raise ConvertError(f"{path}: dtype {manifest['dtype']!r} is not one of {sorted(layout.DTYPES)}")
    if manifest["seq_length"] < 1 or manifest["shard_size"] < 1 or manifest["num_samples"] < 0:
        raise ConvertError(f"{path}: seq_length and shard_size must be >= 1 and num_samples >= 0")
    ids = manifest.get("target_layer_ids")
    if not isinstance(ids, list) or not all(isinstance(i, int) for i in ids):
        raise ConvertError(f"{path}: target_layer_ids must be a list of integers, found {ids!r}")
    try:
        validate_target_layer_ids(ids, manifest["num_hidden_layers"])
    except ValueError as exc:
        raise ConvertError(f"{path}: target_layer_ids: {exc}") from exc
    hidden = manifest["hidden_size"]
    if manifest["target_hidden_dim"] != hidden * len(ids) or manifest["target_last_hidden_dim"] != hidden:
        raise ConvertError(f"{path}: target_hidden_dim {manifest['target_hidden_dim']} / target_last_hidden_dim "
                           f"{manifest['target_last_hidden_dim']} do not fit hidden_size {hidden} x {len(ids)} layers")


def _check_complete(source: NemoSource) -> None:
    complete = source.manifest.get("complete", True)  # absent = a cache older than the marker (NeMo accepts it)
    if complete is not True:
        raise ConvertError(
            f"{source.manifest_path} says complete: {json.dumps(complete)}: NeMo's precompute has not finished "
            f"writing {source.root} (interrupted or still running). Re-run it with the same configuration until "
            "it completes, then convert"
        )
    found = layout.shard_indices(source.root)
    expected = range(source.num_shards)
    if found != list(expected):
        missing = sorted(set(expected) - set(found))
        extra = sorted(set(found) - set(expected))
        detail = "; ".join(part for part in (
            f"missing {[os.path.basename(source.shard_file(k)) for k in missing[:5]]}"
            f"{' and more' if len(missing) > 5 else ''}" if missing else "",
            f"unexpected shard indices {extra[:5]}" if extra else "",
        ) if part)
        raise ConvertError(
            f"{source.root} is partial: {source.manifest_path} declares {source.num_samples} samples in shards of "
            f"{source.shard_size} (shard-000000 .. shard-{max(source.num_shards - 1, 0):06d}), but {detail}. "
            "Re-run NeMo's precompute with the same configuration to restore the shards, then convert"
        )


def open_nemo_source(src: str) -> NemoSource:
    """Open ``src`` as a complete NeMo cache, or raise a :class:`ConvertError` saying what to do."""
    try:
        manifest = layout.read_manifest(src, allow_incomplete=True)
    except FileNotFoundError as exc:
        raise ConvertError(str(exc)) from exc
    except (ValueError, UnicodeDecodeError) as exc:  # JSON syntax errors are ValueErrors too
        raise ConvertError(f"{layout.manifest_path(src)}: {exc}") from exc
    except AttributeError as exc:  # valid JSON, but not an object
        raise ConvertError(f"{layout.manifest_path(src)}: not a JSON object") from exc
    _check_fields(layout.manifest_path(src), manifest)
    source = NemoSource(src, manifest)
    _check_complete(source)
    return source
