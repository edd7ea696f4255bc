"""The target's checkpoint before anything loads: which files transformers will load, refused when
they are not safetensors (unless asked) or not plain files, and fingerprinted (the manifest's
``target_fingerprint``: a checkpoint replaced at the same path is refused on resume); a hub id is
pinned to one commit, asked of the hub once."""

from __future__ import annotations

import hashlib
import json
import logging
import os
from dataclasses import dataclass

from transformers.utils import SAFE_WEIGHTS_INDEX_NAME, SAFE_WEIGHTS_NAME, WEIGHTS_INDEX_NAME, WEIGHTS_NAME

from dspark_cache.format.errors import CacheError
from dspark_cache.producer.hub import HUB_TIMEOUT_S, OFFLINE, HubRefusal, ask_hub, first_line

log = logging.getLogger(__name__)


class TargetError(Exception):
    """The target model directory or id is unusable."""


# The files transformers loads a local checkpoint from, in the order it looks for them
# (modeling_utils._get_resolved_checkpoint_files: the single file before the index), named by its
# own constants; pickles only with --allow-pickle-weights (no use_safetensors=True then lets
# transformers fall back to them). A ``transformers_weights`` key in config.json overrides them all.
SAFETENSORS_FILES = (SAFE_WEIGHTS_NAME, SAFE_WEIGHTS_INDEX_NAME)
PICKLE_FILES = (WEIGHTS_NAME, WEIGHTS_INDEX_NAME)
EXPLICIT_WEIGHTS_KEY = "transformers_weights"
# Every other weight-like file anywhere under the directory is fingerprinted too (a superset of what
# loads), so a file transformers might pick by a rule not mirrored here is never silently skipped.
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".index.json", ".pt", ".pth", ".ckpt", ".gguf", ".h5", ".msgpack")
CONFIG_FILE = "config.json"
MAX_INDEX_BYTES = 64 << 20  # a weight map names each tensor once: megabytes for the largest models
MAX_SAFETENSORS_HEADER = 100 << 20  # the safetensors library's own limit
# Of each weight file's data: DATA_SAMPLES evenly spaced blocks of SAMPLE_BYTES (512 KiB a file).
DATA_SAMPLES, SAMPLE_BYTES = 8, 64 << 10


@dataclass(frozen=True)
class Checkpoint:
    """A resolved target: where transformers loads it from, the hub commit, and its fingerprint."""

    fingerprint: str
    revision: str | None = None


def resolve_checkpoint(path: str, allow_pickle: bool = False) -> Checkpoint:
    """A local checkpoint directory (fingerprinted from its files) or a hub id (pinned to a commit).

    Refuses a checkpoint with no safetensors weights unless ``allow_pickle``, before anything loads.
    """
    if os.path.isdir(path):
        _check_plain_files(path)
        return Checkpoint(local_fingerprint(path, allow_pickle))
    if "/" not in path or path.startswith((".", "/")) or path.count("/") > 1:
        raise TargetError(f"target model {path} does not exist; pass a checkpoint directory or a hub id "
                          "(org/name) to --target-model")
    revision, names = _hub_commit(path)
    _weight_names(path, names, allow_pickle)
    return Checkpoint(f"hub {path}@{revision}", revision)


def _check_plain_files(path: str) -> None:
    """Refuse a checkpoint directory holding a FIFO, device or socket: transformers opens whichever file
    it looks for (config, tokenizer, template) as it is, and would wait on a FIFO or read a device forever."""
    import stat

    from dspark_cache.format.files import kind_of

    for entry in os.scandir(path):
        try:
            mode = os.stat(entry.path).st_mode  # through a symlink: what transformers would open
        except OSError:
            continue  # a dangling link is a missing file: the loader names it if it needs it
        if not (stat.S_ISREG(mode) or stat.S_ISDIR(mode)):
            raise TargetError(f"target model {path}: {entry.name} is {kind_of(mode)}, not a regular file; a "
                              "checkpoint holds plain files only: replace it with the real file")


def _weight_names(where: str, names: list[str], allow_pickle: bool, explicit: str | None = None) -> str:
    """The file transformers will load weights from (an index or a single file), or a refusal.

    ``explicit``: config.json's ``transformers_weights``, which transformers loads instead of looking."""
    if explicit is not None:
        if (not isinstance(explicit, str) or not explicit or os.path.isabs(explicit)
                or ".." in explicit.replace("\\", "/").split("/")):
            raise TargetError(
                f"target model {where}: config.json's {EXPLICIT_WEIGHTS_KEY} {explicit!r} is not a "
                "file inside the checkpoint directory; fix or remove it"
            )
        if not explicit.endswith((".safetensors", ".safetensors.index.json")) and not allow_pickle:
            raise TargetError(
                f"target model {where}: config.json's {EXPLICIT_WEIGHTS_KEY} names pickle weights "
                f"({explicit}), which run arbitrary code when loaded; pass "
                "--allow-pickle-weights if you trust this checkpoint"
            )
        return explicit
    present = set(names)
    for name in SAFETENSORS_FILES + (PICKLE_FILES if allow_pickle else ()):
        if name in present:
            return name
    if any(name in present for name in PICKLE_FILES):
        pickles = ", ".join(sorted(present & set(PICKLE_FILES)))
        raise TargetError(
            f"target model {where} has only pickle weights ({pickles}), which run arbitrary code "
            "when loaded; convert them to safetensors, or pass "
            "--allow-pickle-weights if you trust this checkpoint"
        )
    raise TargetError(
        f"target model {where} has no weights ({' or '.join(SAFETENSORS_FILES)}); pass a complete "
        "checkpoint to --target-model"
    )


def local_fingerprint(path: str, allow_pickle: bool = False) -> str:
    """``sha256`` of what a load reads: ``config.json``, the weight index, and each weight file's
    name, size, header and evenly spaced samples of its data.

    A safetensors header names every tensor with its dtype, shape and byte range, so hashing it
    catches a resized or re-sharded checkpoint; the data samples catch a same-shaped one (another
    fine-tune) without reading its (many GB of) data.
    """
    from dspark_cache.format.files import open_regular, read_regular

    entry = _weight_names(path, os.listdir(path), allow_pickle, _explicit_weights(path))
    files = [entry]
    if entry.endswith(".index.json"):
        index_path = os.path.join(path, entry)
        try:
            weight_map = json.loads(read_regular(index_path, MAX_INDEX_BYTES))["weight_map"]
            files += sorted(set(weight_map.values()))
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
            raise TargetError(
                f"target model {path}: {entry} is not a readable weight index ({first_line(exc)}); "
                "repair or re-download the checkpoint"
            ) from exc
    # What loads first, in the order of earlier versions (so a plain checkpoint keeps its fingerprint),
    # then every other weight file present: replacing any of them is a changed checkpoint.
    extras = [name for name in _weight_files(path) if name not in set(files)]
    digest = hashlib.sha256()
    total = 0
    for name in [CONFIG_FILE, *files, *extras]:
        loaded = name not in extras
        where = os.path.join(path, name)
        try:
            fd = open_regular(where)
        except FileNotFoundError:
            if loaded:
                raise TargetError(
                    f"target model {path}: cannot read {name} (it is missing); the checkpoint is "
                    "incomplete: repair or re-download it"
                ) from None
            digest.update(f"{name}\0dangling\n".encode())  # a dangling link that nothing loads
            continue
        except (OSError, CacheError) as exc:
            raise TargetError(
                f"target model {path}: cannot read {name} ({first_line(exc)}); the checkpoint is "
                "incomplete: repair or re-download it"
            ) from exc
        try:
            size = os.fstat(fd).st_size
            part = _file_digest(fd, name, size, where, strict=loaded)
        finally:
            os.close(fd)
        total += size
        digest.update(f"{name}\0{size}\0{part}\n".encode())
    return f"sha256:{digest.hexdigest()} ({len(files) + len(extras)} weight files, {total} bytes)"


def _explicit_weights(path: str) -> str | None:
    """config.json's ``transformers_weights`` (the file transformers loads instead of looking), if any;
    an unreadable config is left to the fingerprint loop and the loader to name."""
    from dspark_cache.format.files import read_regular

    try:
        config = json.loads(read_regular(os.path.join(path, CONFIG_FILE), MAX_INDEX_BYTES))
    except (OSError, ValueError, CacheError):
        return None
    return config.get(EXPLICIT_WEIGHTS_KEY) if isinstance(config, dict) else None


def _weight_files(path: str) -> list[str]:
    """Every weight-like file under ``path`` (subfolders too, for ``subfolder``/``variant`` loads),
    relative to it, sorted."""
    found = []
    for root, dirs, names in os.walk(path):
        dirs.sort()
        for name in names:
            if name.endswith(WEIGHT_SUFFIXES):
                found.append(os.path.relpath(os.path.join(root, name), path))
    return sorted(found)


def _file_digest(fd: int, name: str, size: int, where: str, strict: bool = True) -> str:
    """sha256 of the part of a checkpoint file that identifies it (see :func:`local_fingerprint`).

    ``strict=False`` (a file that does not load): a damaged safetensors file is sampled, not refused."""
    if name.endswith(".json"):  # config and weight indexes: small, hashed whole
        return hashlib.sha256(os.pread(fd, min(size, MAX_INDEX_BYTES), 0)).hexdigest()
    digest, data_start = hashlib.sha256(), 0
    if name.endswith(".safetensors"):
        length = int.from_bytes(os.pread(fd, 8, 0), "little")
        bad = not 0 < length <= MAX_SAFETENSORS_HEADER or 8 + length > size
        if bad and not strict:
            length = -8  # sampled from byte 0 below
        elif bad:
            raise TargetError(f"{where} is not a safetensors file (truncated or damaged: header of {length} "
                              f"bytes in a {size}-byte file); repair or re-download the checkpoint")
        data_start = 8 + length
        digest.update(os.pread(fd, data_start, 0))
    # The header does not change when a same-shaped checkpoint (a fine-tune) replaces this one:
    # evenly spaced samples of the data do.
    span = size - data_start
    if span <= DATA_SAMPLES * SAMPLE_BYTES:
        digest.update(os.pread(fd, span, data_start))
    else:
        for i in range(DATA_SAMPLES):
            digest.update(
                os.pread(fd, SAMPLE_BYTES, data_start + i * (span - SAMPLE_BYTES) // (DATA_SAMPLES - 1))
            )
    return digest.hexdigest()


def _hub_commit(repo: str) -> tuple[str, list[str]]:
    """The commit a hub id resolves to and its file names: asked once (no retries) when online, from
    the local cache when offline or when the hub cannot be reached. Fails in one line otherwise."""
    from huggingface_hub import try_to_load_from_cache

    try:
        info, reason = ask_hub(lambda api: api.model_info(repo, timeout=HUB_TIMEOUT_S))
    except HubRefusal as exc:
        raise TargetError(f"target model {repo!r} on {exc}") from exc
    if info is not None:
        return str(info.sha), [s.rfilename for s in info.siblings or []]
    cached = try_to_load_from_cache(repo, CONFIG_FILE)
    if not isinstance(cached, str):
        raise TargetError(
            f"target model {repo!r} is not in the local Hugging Face cache and {reason}: download "
            f"it where the hub is reachable (hf download {repo}), or pass a local checkpoint "
            "directory to --target-model"
        )
    snapshot = os.path.dirname(cached)
    if reason != OFFLINE:
        log.warning("target model %s: %s; using its cached snapshot %s", repo, reason, snapshot)
    return os.path.basename(snapshot), os.listdir(snapshot)
