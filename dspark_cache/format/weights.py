"""``target_weights.safetensors``: the one check of the target's ``embed_tokens`` and ``lm_head`` file.

Training initialises the draft from this file, so a damaged one must never be read as weights:
it is opened regular-only (a FIFO or a device would hang or feed a reader forever), its
safetensors header is parsed and bounded before anything is allocated, both tensors must be
``[vocab, hidden]`` of a float dtype and tile the file exactly, and its xxh3-64 must be the one
the manifest recorded when the producer completed the cache. Torch-free: ``dspark-verify`` and
the producer's "already complete" check use it as they are; the torch readers build tensors
from the bytes :func:`read_target_weights` returns.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass

import xxhash

from dspark_cache.format.errors import CacheError
from dspark_cache.format.files import open_regular
from dspark_cache.format.paths import CachePaths
from dspark_cache.format.schema import Manifest

WEIGHT_NAMES = ("embed_tokens.weight", "lm_head.weight")
# Two tensors and a metadata map take a few hundred bytes of header; anything past this is damage.
MAX_WEIGHTS_HEADER = 64 << 10
FLOAT_ITEMSIZE = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2}
_CHUNK = 1 << 22


class TargetWeightsError(CacheError, ValueError):
    """``target_weights.safetensors`` is missing, not a regular file, damaged or not this cache's.

    A ``ValueError`` too: NeMo's recipe catches that type for an unusable cache.
    """

    def __init__(self, path: str, reason: str) -> None:
        # A directory may hold someone's files: the producer never deletes one, the user does.
        first = "Remove that directory, then rerun" if reason.startswith("a directory") else "Rerun"
        super().__init__(f"{path}: {reason}. {first} dspark-produce with the cache's original arguments: it "
                         "rewrites the target weights without recomputing any shard")
        self.path, self.reason = path, reason


@dataclass(frozen=True)
class WeightTensor:
    """Where one tensor's bytes lie in the file (absolute offsets)."""

    dtype: str
    shape: tuple[int, int]
    start: int
    end: int


@dataclass(frozen=True)
class WeightsFile:
    """A checked weights file: its tensors, its size and (when read or hashed) its xxh3-64."""

    tensors: dict[str, WeightTensor]
    size: int
    xxh3: int


def parse_header(path: str, head: bytes, size: int, vocab_size: int | None, hidden_size: int | None
                 ) -> dict[str, WeightTensor]:
    """The two tensors of a weights file from its first bytes (``head`` holds at least the header).

    ``vocab_size``/``hidden_size``: the shape both must have (None: not checked, a NeMo cache
    without those manifest fields).
    """
    if size < 8 or len(head) < 8:
        raise TargetWeightsError(path, f"{size} bytes, too short for a safetensors header (truncated)")
    length = int.from_bytes(head[:8], "little")
    if not 2 <= length <= MAX_WEIGHTS_HEADER or 8 + length > size:
        raise TargetWeightsError(
            path,
            f"its header claims {length} bytes in a {size}-byte file (truncated or not a safetensors file)",
        )
    if len(head) < 8 + length:
        raise TargetWeightsError(path, "short read of its header")
    try:
        header = json.loads(head[8:8 + length])
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise TargetWeightsError(path, f"its header is not valid JSON ({exc})") from exc
    if not isinstance(header, dict):
        raise TargetWeightsError(path, "its header is not a JSON object")
    header.pop("__metadata__", None)
    if sorted(header) != sorted(WEIGHT_NAMES):
        raise TargetWeightsError(path, f"it holds {sorted(header)}, not exactly {list(WEIGHT_NAMES)}")
    tensors = {
        name: _tensor(path, name, header[name], 8 + length, vocab_size, hidden_size) for name in WEIGHT_NAMES
    }
    spans = sorted((t.start, t.end) for t in tensors.values())
    if spans[0][0] != 8 + length or spans[0][1] != spans[1][0] or spans[1][1] != size:
        raise TargetWeightsError(
            path,
            f"its tensors cover bytes {spans} of a {size}-byte file whose data starts "
            f"at {8 + length} (truncated, extended or overlapping)",
        )
    return tensors


def _tensor(path: str, name: str, info: object, data_start: int, vocab_size: int | None,
            hidden_size: int | None) -> WeightTensor:
    if not isinstance(info, dict):
        raise TargetWeightsError(path, f"{name}'s header entry is not an object")
    dtype, shape, offsets = info.get("dtype"), info.get("shape"), info.get("data_offsets")
    if dtype not in FLOAT_ITEMSIZE:
        raise TargetWeightsError(path, f"{name} has dtype {dtype!r}, not one of {sorted(FLOAT_ITEMSIZE)}")
    if not (isinstance(shape, list) and len(shape) == 2 and all(type(n) is int and n >= 1 for n in shape)):
        raise TargetWeightsError(path, f"{name} has shape {shape!r}, not [vocab, hidden]")
    want = [
        vocab_size if vocab_size is not None else shape[0],
        hidden_size if hidden_size is not None else shape[1],
    ]
    if shape != want:
        raise TargetWeightsError(path, f"{name} has shape {shape}, the manifest says [{want[0]}, {want[1]}] "
                                 "(target_vocab_size, hidden_size): it is another target's")
    if not (isinstance(offsets, list) and len(offsets) == 2 and all(type(n) is int for n in offsets)):
        raise TargetWeightsError(path, f"{name} has data_offsets {offsets!r}")
    begin, end = offsets
    if end - begin != shape[0] * shape[1] * FLOAT_ITEMSIZE[dtype] or begin < 0:
        raise TargetWeightsError(path, f"{name}'s data_offsets {offsets} do not hold {dtype} x {shape}")
    return WeightTensor(dtype, (shape[0], shape[1]), data_start + begin, data_start + end)


def _open(path: str, within: str | None) -> int:
    try:
        return open_regular(path, within)
    except (FileNotFoundError, NotADirectoryError) as exc:
        raise TargetWeightsError(path, "missing") from exc
    except CacheError as exc:  # a FIFO, a device, a directory, a symlink out of the cache
        raise TargetWeightsError(path, getattr(exc, "reason", str(exc))) from exc


def _checked(path: str, got: int, want: int | None) -> None:
    if want is not None and got != want:
        raise TargetWeightsError(
            path, f"its xxh3-64 is {got:#018x}, the manifest recorded {want:#018x} (damaged or replaced)"
        )


def check_target_weights(path: str, vocab_size: int | None, hidden_size: int | None, xxh3: int | None = None,
                         within: str | None = None) -> WeightsFile:
    """Check the file without holding it in memory (read through a small buffer)."""
    fd = _open(path, within)
    try:
        size = os.fstat(fd).st_size
        head = os.pread(fd, 8 + MAX_WEIGHTS_HEADER, 0)
        tensors = parse_header(path, head, size, vocab_size, hidden_size)
        digest, buf, seen = xxhash.xxh3_64(), bytearray(_CHUNK), 0
        while n := os.readv(fd, [buf]):
            digest.update(memoryview(buf)[:n])
            seen += n
        if seen != size:  # a file that changes size while read is not a finished file
            raise TargetWeightsError(path, f"read {seen} bytes of a {size}-byte file (changed while read)")
    finally:
        os.close(fd)
    _checked(path, digest.intdigest(), xxh3)
    return WeightsFile(tensors, size, digest.intdigest())


def read_target_weights(path: str, vocab_size: int | None, hidden_size: int | None, xxh3: int | None = None,
                        within: str | None = None) -> tuple[bytearray, WeightsFile]:
    """The whole file, checked, and where its tensors lie in it (one read: no second copy)."""
    fd = _open(path, within)
    try:
        size = os.fstat(fd).st_size
        tensors = parse_header(path, os.pread(fd, 8 + MAX_WEIGHTS_HEADER, 0), size, vocab_size, hidden_size)
        data = bytearray(size)  # bounded: the header's shapes, which tile the file, account for every byte
        view, seen = memoryview(data), 0
        while seen < size and (n := os.preadv(fd, [view[seen:]], seen)):
            seen += n
        if seen != size or os.pread(fd, 1, size):
            raise TargetWeightsError(path, f"the file changed size while read ({size} bytes at first)")
    finally:
        os.close(fd)
    digest = xxhash.xxh3_64_intdigest(data)
    _checked(path, digest, xxh3)
    return data, WeightsFile(tensors, size, digest)


def check_cache_weights(paths: CachePaths, manifest: Manifest) -> WeightsFile:
    """A dspark cache's weights file against its manifest (shapes, and the checksum once recorded)."""
    return check_target_weights(paths.target_weights, manifest.target_vocab_size, manifest.hidden_size,
                                manifest.target_weights_xxh3, within=os.path.realpath(paths.root))


def weights_problem(paths: CachePaths, manifest: Manifest) -> str | None:
    """Why the cache's weights file cannot be used (its message), or None when it checks out."""
    try:
        check_cache_weights(paths, manifest)
    except TargetWeightsError as exc:
        return str(exc)
    except OSError as exc:  # an I/O error reading it
        return f"{paths.target_weights}: cannot be read ({exc})"
    return None
