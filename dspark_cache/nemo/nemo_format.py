"""NeMo Automodel 0.7.0's own DSpark cache format: the one place that knows its files and fields.

A NeMo cache is a directory with ``manifest.json`` (``format_version: 1``), the target's
``target_weights.safetensors`` and ``shard-NNNNNN.safetensors`` files, each holding the four
``CACHE_KEYS`` tensors for ``shard_size`` consecutive samples, padded to ``seq_length`` (ids and
masks int64). Sample ``i`` lives in shard ``i // shard_size``, row ``i % shard_size``.

Reading follows NeMo's rules and errors (same exception types, the same conditions), so that
``dspark_cache.nemo`` behaves exactly like NeMo's original on such a cache; writing produces
files NeMo's unmodified reader accepts (``dspark-convert --to nemo``).
"""

from __future__ import annotations

import json
import os
import re
from typing import Any, Iterable

import torch
from safetensors import safe_open

from dspark_cache.format import weights
from dspark_cache.format.atomic import atomic_write_bytes
from dspark_cache.format.errors import CacheError
from dspark_cache.format.files import read_regular, regular_size
from dspark_cache.format.schema import LEGACY_FORMAT
from dspark_cache.format.validate import MAX_MANIFEST_BYTES

MANIFEST = "manifest.json"
TARGET_WEIGHTS = "target_weights.safetensors"
FORMAT_VERSION = 1
SHARD_RE = re.compile(r"^shard-(\d{6})\.safetensors$")
PARTIAL_SUFFIX = ".partial"
# Shard partials, and format.atomic's temporaries of the manifest and the copied weights.
_LEFTOVER_RE = re.compile(
    r"^shard-\d{6,}\.safetensors\.partial$|^(manifest\.json|target_weights\.safetensors)\.\d+\.\d+\.tmp$"
)
CACHE_KEYS = ("input_ids", "loss_mask", "target_hidden_states", "target_last_hidden_states")
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
# Fields NeMo added after its first release, with the value older producers effectively used.
MANIFEST_DEFAULTS: dict[str, Any] = {"mask_reasoning_content": False, "mask_generation_prompt": False}
# Every field NeMo 0.7.0's ``build_cache_manifest`` writes (``format_version`` is added on write,
# ``complete`` by the producers).
MANIFEST_FIELDS = (
    "target_model", "target_model_type", "target_vocab_size", "hidden_size", "num_hidden_layers",
    "seq_length", "dtype", "num_samples", "shard_size", "target_hidden_dim", "target_last_hidden_dim",
    "target_layer_ids", "train_data_path", "train_split", "shuffle_seed", "mask_reasoning_content",
    "mask_generation_prompt", "chat_template_sha256",
)


def manifest_path(cache_dir: str) -> str:
    return os.path.join(cache_dir, MANIFEST)


def target_weights_path(cache_dir: str) -> str:
    return os.path.join(cache_dir, TARGET_WEIGHTS)


def shard_path(cache_dir: str, shard_index: int) -> str:
    return os.path.join(cache_dir, f"shard-{shard_index:06d}.safetensors")


def partial_path(path: str) -> str:
    """Where a file of this format is written before it is renamed into place (never read)."""
    return path + PARTIAL_SUFFIX


def is_leftover(name: str) -> bool:
    """A half-written file of this format (a shard or the weights) or an atomic manifest write."""
    return bool(_LEFTOVER_RE.match(name))


def shard_indices(cache_dir: str) -> list[int]:
    """Indices of the ``shard-NNNNNN.safetensors`` files present, ascending."""
    try:
        names = os.listdir(cache_dir)
    except (FileNotFoundError, NotADirectoryError):
        return []
    return sorted(int(m.group(1)) for m in map(SHARD_RE.match, names) if m)


def _raw_manifest(cache_dir: str) -> dict[str, Any] | None:
    # A FIFO is not a manifest either, nor JSON nested past the parser's depth (RecursionError).
    try:
        data = json.loads(read_regular(manifest_path(cache_dir), MAX_MANIFEST_BYTES))
    except (OSError, CacheError, json.JSONDecodeError, UnicodeDecodeError, RecursionError):
        return None
    return data if isinstance(data, dict) else None


def is_nemo_cache(cache_dir: str) -> bool:
    """True for a directory in NeMo's format: its manifest says ``format_version: 1`` (the integer;
    ours is a string), or it has NeMo shard files and no manifest of any kind."""
    manifest = _raw_manifest(cache_dir)
    if manifest is not None:
        version = manifest.get("format_version")
        # dspark-cache 0.1 also wrote version 1, marked with its cache_format.
        ours = manifest.get("cache_format") == LEGACY_FORMAT
        return version == FORMAT_VERSION and not isinstance(version, bool) and not ours
    return not os.path.exists(manifest_path(cache_dir)) and bool(shard_indices(cache_dir))


def read_manifest(cache_dir: str, allow_incomplete: bool = False) -> dict[str, Any]:
    """NeMo's ``read_manifest``: the manifest dict, its late fields defaulted; an incomplete
    cache is refused unless ``allow_incomplete``."""
    path = manifest_path(cache_dir)
    if not os.path.exists(path):
        raise FileNotFoundError(
            f"DSpark cache manifest not found at {path}. Was the cache fully written? Run the producer "
            "(dspark-produce or precompute_dspark) into this directory first."
        )
    try:
        manifest = json.loads(read_regular(path, MAX_MANIFEST_BYTES))  # never a FIFO's endless wait
    except CacheError as exc:
        raise ValueError(str(exc)) from exc
    except RecursionError as exc:  # the parser stops at the interpreter's depth limit: memory stays bounded
        raise ValueError(f"{path} is nested too deeply to be a manifest; regenerate the cache") from exc
    version = manifest.get("format_version")
    if version != FORMAT_VERSION:
        raise ValueError(
            f"DSpark cache at {cache_dir} has format_version={version!r}, expected {FORMAT_VERSION}. "
            "Regenerate the cache with the current precompute_dspark."
        )
    manifest = {**MANIFEST_DEFAULTS, **manifest}
    if not allow_incomplete:
        ensure_complete(manifest, cache_dir)
    return manifest


def ensure_complete(manifest: dict[str, Any], cache_dir: str) -> None:
    """An interrupted or running producer's cache is refused (a missing marker is a legacy cache)."""
    if manifest.get("complete", True) is not True:
        raise ValueError(
            f"DSpark cache at {cache_dir} is marked incomplete (its precompute was interrupted or is still "
            "running). Re-run the precompute with the same configuration to finish it, or delete the "
            "directory and regenerate."
        )


def check_shards(cache_dir: str, num_samples: int, shard_size: int) -> list[int]:
    """The shard files must be exactly ``0..ceil(num_samples / shard_size) - 1``."""
    indices = shard_indices(cache_dir)
    expected = -(-num_samples // shard_size)
    if indices != list(range(expected)):
        raise ValueError(
            f"DSpark cache at {cache_dir} declares {num_samples} samples ({expected} shards) but found shard "
            f"indices {indices}. Re-run the precompute with the same configuration to restore the missing shards."
        )
    return indices


def write_manifest(cache_dir: str, manifest: dict[str, Any]) -> None:
    """Write ``manifest.json`` as NeMo does (``format_version`` first, indented, sorted keys), atomically."""
    text = json.dumps({"format_version": FORMAT_VERSION, **manifest}, indent=2, sort_keys=True)
    atomic_write_bytes(manifest_path(cache_dir), text.encode())


def read_target_weights(path: str, vocab_size: int | None = None, hidden_size: int | None = None,
                        xxh3: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(embed_tokens.weight, lm_head.weight)`` from a ``target_weights.safetensors`` file, checked
    (``format.weights``: regular file inside its cache, header, shapes ``[vocab_size, hidden_size]``
    where given, checksum where recorded). Both tensors are views of the one buffer read."""
    try:
        data, checked = weights.read_target_weights(path, vocab_size, hidden_size, xxh3,
                                                    within=os.path.realpath(os.path.dirname(path)))
    except weights.TargetWeightsError as exc:
        if exc.reason != "missing":
            raise
        raise FileNotFoundError(
            f"{path} not found. The DSpark offline cache must include target embed_tokens and lm_head weights "
            "so training can skip loading the target model; rerun the producer (dspark-produce with the cache's "
            "original arguments) to write them: no shard is recomputed."
        ) from exc
    return _weight(data, checked.tensors["embed_tokens.weight"]), _weight(
        data, checked.tensors["lm_head.weight"]
    )


_TORCH_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}


def _weight(data: bytearray, tensor: weights.WeightTensor) -> torch.Tensor:
    dtype = _TORCH_DTYPES[tensor.dtype]
    if tensor.start % 8:  # a header not padded to 8 bytes leaves the data unaligned: copy it out
        return torch.frombuffer(bytearray(data[tensor.start:tensor.end]), dtype=dtype).view(tensor.shape)
    count = (tensor.end - tensor.start) // dtype.itemsize
    return torch.frombuffer(data, dtype=dtype, count=count, offset=tensor.start).view(tensor.shape)


def weight_shape(cache_dir: str) -> tuple[int | None, int | None]:
    """``(target_vocab_size, hidden_size)`` from a NeMo cache's manifest, where it records them."""
    manifest = _raw_manifest(cache_dir) or {}
    vocab, hidden = manifest.get("target_vocab_size"), manifest.get("hidden_size")
    return (vocab if type(vocab) is int else None), (hidden if type(hidden) is int else None)


class NemoCacheDataset(torch.utils.data.Dataset):
    """Samples of a NeMo cache by index: each a dict of the four padded ``CACHE_KEYS`` tensors.

    Validates as NeMo's ``CachedDSparkDataset`` does (version, contiguous shards, complete) and
    opens each shard lazily, once.
    """

    def __init__(self, cache_dir: str) -> None:
        self.cache_dir = cache_dir
        self.manifest = read_manifest(cache_dir, allow_incomplete=True)
        self.shard_size = int(self.manifest["shard_size"])
        self.num_samples = int(self.manifest["num_samples"])
        self.shard_indices = check_shards(cache_dir, self.num_samples, self.shard_size)
        ensure_complete(self.manifest, cache_dir)
        self._handles: dict[int, Any] = {}

    def __len__(self) -> int:
        return self.num_samples

    def _handle(self, shard_index: int) -> Any:
        handle = self._handles.get(shard_index)
        if handle is None:
            path = shard_path(self.cache_dir, shard_index)
            try:
                regular_size(path)  # safe_open would wait forever on a FIFO, or map a device
            except CacheError as exc:
                raise ValueError(str(exc)) from exc
            handle = self._handles[shard_index] = safe_open(path, framework="pt")
        return handle

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        if index < 0:
            index += self.num_samples
        if not 0 <= index < self.num_samples:
            raise IndexError(index)
        handle = self._handle(index // self.shard_size)
        return {key: handle.get_slice(key)[index % self.shard_size] for key in CACHE_KEYS}


def stack_samples(samples: Iterable[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """Stack per-sample dicts into one batch of the four ``CACHE_KEYS``."""
    samples = list(samples)
    return {key: torch.stack([s[key] for s in samples], dim=0) for key in CACHE_KEYS}
