"""A NeMo-format cache opened for import: manifest and shard set checked, shards opened lazily.

Everything is checked before anything is written: a partial cache (``complete`` false, shards
missing) is refused, and every shard's tensors must have the names, dtypes and shapes its
manifest implies (NeMo's own reader checks none of this; a bad shard would surface mid-training).
"""

from __future__ import annotations

import itertools
import json
import os
from dataclasses import dataclass
from typing import Any

import torch

from dspark_cache.format.files import FileTooLargeError, NotARegularFileError, read_regular
from dspark_cache.format.layers import validate_target_layer_ids
from dspark_cache.format.validate import MAX_MANIFEST_BYTES
from dspark_cache.nemo import nemo_format
from dspark_cache.nemo.convert.common import ConvertError, ConvertUsageError
from dspark_cache.nemo.convert.stfile import SafetensorsFile

_INT_FIELDS = (
    "target_vocab_size",
    "hidden_size",
    "num_hidden_layers",
    "seq_length",
    "num_samples",
    "shard_size",
    "target_hidden_dim",
    "target_last_hidden_dim",
    "shuffle_seed",
)
_STR_FIELDS = ("target_model", "target_model_type", "dtype", "train_data_path", "chat_template_sha256")
_BOOL_FIELDS = ("mask_reasoning_content", "mask_generation_prompt")
# Fields that size something: at least 1. Every integer must also fit int64, as our manifest stores it.
_POSITIVE_FIELDS = ("target_vocab_size", "hidden_size", "num_hidden_layers", "seq_length", "shard_size")
_INT64 = 2**63
_INT32_MAX = 2**31 - 1  # sample lengths are stored as int32


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
        return nemo_format.DTYPES[self.manifest["dtype"]]

    @property
    def num_shards(self) -> int:
        return -(-self.num_samples // self.shard_size)

    @property
    def manifest_path(self) -> str:
        return nemo_format.manifest_path(self.root)

    def shard_file(self, shard: int) -> str:
        return nemo_format.shard_path(self.root, shard)

    def rows(self, shard: int) -> range:
        """Sample ids (= NeMo indices) held by ``shard``."""
        return range(shard * self.shard_size, min(self.num_samples, (shard + 1) * self.shard_size))

    @property
    def vocab_size(self) -> int:
        return self._int("target_vocab_size")

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
                                       f"{', '.join(nemo_format.CACHE_KEYS)}")
                if got.dtype != dtype or got.shape != shape:
                    raise ConvertError(
                        f"{handle.path}: {key} is {got.dtype} {list(got.shape)}, but "
                        f"{self.manifest_path} implies {dtype} {list(shape)} for shard {shard}"
                    )
        except BaseException:
            handle.close()
            raise
        return handle


def _check_fields(path: str, manifest: dict[str, Any]) -> None:
    """Types and ranges first, so nothing sized by a field (arrays, shapes) trusts a lie."""
    for name in _INT_FIELDS:
        value = manifest.get(name)
        if not isinstance(value, int) or isinstance(value, bool) or not -_INT64 <= value < _INT64:
            raise ConvertError(f"{path}: field {name} must be a 64-bit integer, found {value!r:.100}")
    for name in _STR_FIELDS:
        if not isinstance(manifest.get(name), str):
            raise ConvertError(f"{path}: field {name} must be a string, found {manifest.get(name)!r:.100}")
    for name in _BOOL_FIELDS:
        if not isinstance(manifest.get(name), bool):
            raise ConvertError(
                f"{path}: field {name} must be true or false, found {manifest.get(name)!r:.100}"
            )
    if manifest.get("train_split") is not None and not isinstance(manifest["train_split"], str):
        raise ConvertError(f"{path}: field train_split must be a string or null, "
                           f"found {manifest['train_split']!r:.100}")
    if manifest["dtype"] not in nemo_format.DTYPES:
        raise ConvertError(f"{path}: dtype {manifest['dtype']!r} is not one of {sorted(nemo_format.DTYPES)}")
    small = [name for name in _POSITIVE_FIELDS if manifest[name] < 1]
    if small or manifest["num_samples"] < 0 or manifest["seq_length"] > _INT32_MAX:
        raise ConvertError(
            f"{path}: {', '.join(small) or 'seq_length or num_samples'} out of range: "
            f"{', '.join(_POSITIVE_FIELDS)} must be >= 1, num_samples >= 0 and seq_length < 2^31"
        )
    ids = manifest.get("target_layer_ids")
    if not isinstance(ids, list) or not all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
        raise ConvertError(f"{path}: target_layer_ids must be a list of integers, found {ids!r:.100}")
    try:
        validate_target_layer_ids(ids, manifest["num_hidden_layers"])
    except ValueError as exc:
        raise ConvertError(f"{path}: target_layer_ids: {exc}") from exc
    hidden = manifest["hidden_size"]
    if manifest["target_hidden_dim"] != hidden * len(ids) or manifest["target_last_hidden_dim"] != hidden:
        raise ConvertError(
            f"{path}: target_hidden_dim {manifest['target_hidden_dim']} / target_last_hidden_dim "
            f"{manifest['target_last_hidden_dim']} do not fit hidden_size {hidden} x {len(ids)} layers"
        )


def _check_complete(source: NemoSource) -> None:
    # absent = a cache older than the marker (NeMo accepts it)
    complete = source.manifest.get("complete", True)
    if complete is not True:
        raise ConvertError(
            f"{source.manifest_path} says complete: {json.dumps(complete)}: NeMo's precompute has not finished "
            f"writing {source.root} (interrupted or still running). Re-run it with the same configuration until "
            "it completes, then convert"
        )
    found = nemo_format.shard_indices(source.root)
    # num_shards comes from the manifest and may be a lie of 10^12: only the listing sizes anything.
    if len(found) != source.num_shards or found != list(range(len(found))):
        present = set(found)
        missing = list(itertools.islice((k for k in range(source.num_shards) if k not in present), 6))
        extra = [k for k in found if k >= source.num_shards]
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


def _check_manifest_file(src: str) -> None:
    """SRC's ``manifest.json``, where there is one, must be a plain JSON object a manifest's size:
    a FIFO would block the read, ``/dev/zero`` feed it without end, deep nesting crash the parser."""
    path = nemo_format.manifest_path(src)
    try:
        data = read_regular(path, MAX_MANIFEST_BYTES)
    except FileNotFoundError:
        return
    except NotARegularFileError as exc:
        raise ConvertError(
            f"{path} is {exc.reason}: put NeMo's manifest.json there (a plain file), or re-run "
            "NeMo's precompute"
        ) from exc
    except FileTooLargeError as exc:
        raise ConvertError(
            f"{path} is {exc.size} bytes, far more than a NeMo manifest (~1 KB): it is not one; "
            "restore NeMo's manifest.json or re-run NeMo's precompute"
        ) from exc
    try:
        manifest = json.loads(data)
    except (ValueError, RecursionError) as exc:  # RecursionError: nested past the parser's depth
        raise ConvertError(
            f"{path}: not a JSON manifest ({type(exc).__name__}: {exc!s:.200}); restore NeMo's "
            "manifest.json or re-run NeMo's precompute"
        ) from exc
    if not isinstance(manifest, dict):
        raise ConvertError(
            f"{path}: not a JSON object; restore NeMo's manifest.json or re-run NeMo's precompute"
        )


def open_nemo_source(src: str) -> NemoSource:
    """Open ``src`` as a complete NeMo cache, or raise a :class:`ConvertError` saying what to do
    (a :class:`ConvertUsageError` when ``src`` is not in NeMo's format at all)."""
    _check_manifest_file(src)
    if not nemo_format.is_nemo_cache(src):
        raise ConvertUsageError(f"{src} is not a NeMo-layout cache (no manifest.json with format_version 1); "
                                "to export a dspark cache use --to nemo")
    try:
        manifest = nemo_format.read_manifest(src, allow_incomplete=True)
    except FileNotFoundError as exc:
        raise ConvertError(str(exc)) from exc
    except (ValueError, UnicodeDecodeError) as exc:  # JSON syntax errors are ValueErrors too
        raise ConvertError(f"{nemo_format.manifest_path(src)}: {exc}") from exc
    except AttributeError as exc:  # valid JSON, but not an object
        raise ConvertError(f"{nemo_format.manifest_path(src)}: not a JSON object") from exc
    _check_fields(nemo_format.manifest_path(src), manifest)
    source = NemoSource(src, manifest)
    _check_complete(source)
    for shard in range(source.num_shards):  # every header before anything is sized by num_samples
        source.open_shard(shard).close()
    return source
