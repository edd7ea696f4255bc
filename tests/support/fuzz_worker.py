"""Runs fuzz cases against a pristine cache in one process; the test watches it from outside.

Usage: ``python -m tests.support.fuzz_worker PRISTINE WORKDIR SEED FIRST COUNT [FAMILY]``. For each case it
copies the pristine cache, applies one seeded mutation of ``FAMILY`` (:data:`FAMILIES`; ``cache`` by
default), reads the copy through ``open_cache``, the loader (native and Python fillers) and
``verify_cache``, and prints one JSON line:
``{"case", "mutation", "outcome"}`` with outcome ``same`` (exactly the original samples),
``rejected`` (a ``CacheError`` naming a file of the cache) or ``FAIL: ...``. A ``start`` line is
printed before each case, so a hang or a signal is pinned on its case by the watcher.
"""

from __future__ import annotations

import json
import os
import random
import resource
import shutil
import struct
import sys
import traceback

from dspark_cache.format.paths import CachePaths

MEMORY_LIMIT = 6 << 30  # address space: a runaway allocation fails here instead of hurting the machine


def main(pristine: str, workdir: str, seed: int, first: int, count: int, family: str = "cache") -> None:
    resource.setrlimit(resource.RLIMIT_AS, (MEMORY_LIMIT, MEMORY_LIMIT))
    import dspark_cache

    original = {s["sample_id"]: s for s in dspark_cache.open_cache(pristine).samples()}
    for case in range(first, first + count):
        rng = random.Random(seed * 1_000_003 + case)
        target = os.path.join(workdir, f"case-{case}")
        shutil.copytree(pristine, target)
        mutation = FAMILIES[family](target, rng)
        print(json.dumps({"start": case, "mutation": mutation}), flush=True)
        outcome = run_case(target, original, extra_readers=EXTRA_READERS.get(family, ()))
        print(json.dumps({"case": case, "mutation": mutation, "outcome": outcome}), flush=True)
        shutil.rmtree(target, ignore_errors=True)


# -- mutations --------------------------------------------------------------------------------

_VALUES = [0, -1, 1, 7, 4096, 2**31, 2**63, -(2**63), 10**30, "x", None, 1.5, [], {}]


def _nudge(value, rng: random.Random):
    if isinstance(value, bool) or not isinstance(value, int):
        return rng.choice(_VALUES)
    return rng.choice(
        [value + 1, value - 1, value * 2, -value, value + 512, value + 4096, rng.choice(_VALUES)]
    )


def _json_files(root: str, rng: random.Random, kind: str) -> str:
    paths = CachePaths(root)
    if kind == "manifest":
        return paths.manifest
    return paths.shard_index(rng.choice(paths.indexed_shard_ids()))


def mutate(root: str, rng: random.Random) -> str:
    kind = rng.choice(["index", "index", "index", "manifest", "manifest", "tar", "tar", "header", "special"])
    return {"index": _mutate_index, "manifest": _mutate_manifest, "tar": _mutate_tar,
            "header": _mutate_header, "special": _mutate_special}[kind](root, rng)


def _mutate_index(root: str, rng: random.Random) -> str:
    path = _json_files(root, rng, "index")
    data = json.load(open(path))
    how = rng.choice(["field", "field", "field", "drop", "duplicate", "swap", "top", "bytes"])
    entries = data["samples"]
    k = rng.randrange(len(entries))
    if how == "field":
        column = rng.randrange(6)  # sample_id, length, loss_tokens, offset, size, xxh3
        entries[k][column] = _nudge(entries[k][column], rng)
    elif how == "drop":
        entries.pop(k)
    elif how == "duplicate":
        entries.insert(k, list(entries[k]))
    elif how == "swap" and len(entries) > 1:
        j = (k + 1) % len(entries)
        entries[k][0], entries[j][0] = entries[j][0], entries[k][0]
    elif how == "top":
        key = rng.choice(["shard_id", "tar_bytes", "tar_xxh3", "nonfinite", "format_version"])
        data[key] = _nudge(data.get(key), rng)
    else:
        raw = bytearray(json.dumps(data).encode())
        raw[rng.randrange(len(raw))] = rng.randrange(256)
        open(path, "wb").write(bytes(raw))
        return f"index: {os.path.basename(path)} byte flip"
    json.dump(data, open(path, "w"))
    return f"index: {os.path.basename(path)} {how} (entry {k})"


def _mutate_manifest(root: str, rng: random.Random) -> str:
    path = _json_files(root, rng, "manifest")
    data = json.load(open(path))
    key = rng.choice(sorted(data))
    how = rng.choice(["nudge", "nudge", "nudge", "delete", "truncate"])
    if how == "delete":
        del data[key]
    elif how == "truncate":
        raw = open(path, "rb").read()
        open(path, "wb").write(raw[: rng.randrange(len(raw))])
        return "manifest: truncated"
    elif key == "target_layer_ids":
        data[key] = rng.choice([[], [0], [-2, 1], [1, 1], [1, 2, 3, 4, 5, 6, 7, 8, 9], [5, 1]])
    elif key == "dtype":
        data[key] = rng.choice(["fp16", "fp32", "int4", "", None])
    else:
        data[key] = _nudge(data[key], rng)
    json.dump(data, open(path, "w"))
    return f"manifest: {how} {key}"


def _tars(root: str) -> list[str]:
    paths = CachePaths(root)
    return [paths.shard_tar(shard) for shard in paths.indexed_shard_ids()]


def _mutate_tar(root: str, rng: random.Random) -> str:
    path = rng.choice(_tars(root))
    size = os.path.getsize(path)
    how = rng.choice(["flip", "flip", "flip", "truncate", "append"])
    if how == "flip":
        with open(path, "r+b") as handle:
            at = rng.randrange(size)
            handle.seek(at)
            byte = handle.read(1)
            handle.seek(at)
            handle.write(bytes([byte[0] ^ (1 << rng.randrange(8))]))
        return f"tar: {os.path.basename(path)} bit flip at {at}"
    if how == "truncate":
        os.truncate(path, rng.randrange(size))
    else:
        with open(path, "ab") as handle:
            handle.write(os.urandom(rng.choice([1, 512, 5000])))
    return f"tar: {os.path.basename(path)} {how}"


def _mutate_header(root: str, rng: random.Random) -> str:
    """A byte of a sample's safetensors header (its JSON), where a lie would shape the tensors."""
    paths = CachePaths(root)
    shard = rng.choice(paths.indexed_shard_ids())
    path = paths.shard_tar(shard)
    index = json.load(open(paths.shard_index(shard)))
    entry = rng.choice(index["samples"])
    with open(path, "r+b") as handle:
        handle.seek(entry[3] + 8)
        text = handle.read(600)
        at = rng.randrange(len(text))
        handle.seek(entry[3] + 8 + at)
        handle.write(bytes([rng.choice(b'0123456789",:{}[]x ')]))
    return f"header: sample {entry[0]} in {os.path.basename(path)} at {at}"


def _mutate_special(root: str, rng: random.Random) -> str:
    paths = CachePaths(root)
    shards = paths.indexed_shard_ids()
    path = rng.choice(
        [paths.shard_tar(i) for i in shards] + [paths.shard_index(i) for i in shards] + [paths.manifest]
    )
    os.unlink(path)
    how = rng.choice(["fifo", "dev_zero", "directory", "dangling"])
    {"fifo": lambda: os.mkfifo(path), "dev_zero": lambda: os.symlink("/dev/zero", path),
     "directory": lambda: os.mkdir(path), "dangling": lambda: os.symlink(path + ".gone", path)}[how]()
    return f"special: {os.path.basename(path)} replaced by {how}"


# -- FP8 scales and codes, with the checksums made to match (a crafted cache, not a flipped bit) ----

# Each breaks the FP8 rule (format.sample.fp8_bad_scales): NaN, infinities, zero and -0, negative,
# and finite scales whose largest state overflows: as float32 (1e36 x 448) and only as bf16.
_BAD_SCALES = [float("nan"), float("inf"), float("-inf"), 0.0, -0.0, -1.0, -1e-30, 1e36, 3.3965e38 / 448]
_BAD_CODES = {"F8_E4M3": [0x7F, 0xFF], "F8_E5M2": [0x7C, 0xFC, 0x7D, 0xFF]}


def _sample_tensors(raw: bytes, offset: int) -> dict[str, tuple[str, int, int]]:
    """name -> (dtype code, first byte, end) in the tar, from the sample's own safetensors header."""
    (header_len,) = struct.unpack_from("<Q", raw, offset)
    header = json.loads(raw[offset + 8 : offset + 8 + header_len])
    base = offset + 8 + header_len
    return {name: (t["dtype"], base + t["data_offsets"][0], base + t["data_offsets"][1])
            for name, t in header.items() if name != "__metadata__" and not name.startswith("__pad")}


def _random_shard(paths: CachePaths, rng: random.Random) -> tuple[str, str, dict, bytearray]:
    """One published shard, drawn by ``rng``: its tar's path, its index's path, the index as JSON and
    the tar's bytes (to mutate and write back)."""
    shard = rng.choice(paths.indexed_shard_ids())
    path, index_path = paths.shard_tar(shard), paths.shard_index(shard)
    return path, index_path, json.load(open(index_path)), bytearray(open(path, "rb").read())


def _mutate_fp8(root: str, rng: random.Random) -> str:
    """A hostile scale or NaN/inf code in one sample, its sample and tar checksums rewritten to match."""
    import xxhash

    path, index_path, index, raw = _random_shard(CachePaths(root), rng)
    k = rng.randrange(len(index["samples"]))
    entry = index["samples"][k]
    tensors = _sample_tensors(bytes(raw), entry[3])
    states = rng.choice([n for n in ("target_hidden_states", "target_last_hidden_states") if n in tensors])
    code = tensors["target_hidden_states"][0]
    if rng.random() < 0.6:
        name = states + "_scale"
        _, start, end = tensors[name]
        at = start + 4 * rng.randrange((end - start) // 4)
        value = rng.choice(_BAD_SCALES)
        raw[at : at + 4] = struct.pack("<f", value)
        what = f"{name} = {value!r}"
    else:
        _, start, end = tensors[states]
        at = start + rng.randrange(end - start)
        value = rng.choice(_BAD_CODES[code])
        raw[at] = value
        what = f"{states} code 0x{value:02X}"
    entry[5] = xxhash.xxh3_64_intdigest(bytes(raw[entry[3] : entry[3] + entry[4]]))
    index["tar_xxh3"] = xxhash.xxh3_64_intdigest(bytes(raw))
    open(path, "wb").write(bytes(raw))
    json.dump(index, open(index_path, "w"))
    return f"fp8: sample {entry[0]} in {os.path.basename(path)}: {what} at byte {at}"


def mutate_fp8(root: str, rng: random.Random) -> str:
    """Mostly crafted FP8 damage; the rest, the generic mutations on an FP8 cache's geometry."""
    return _mutate_fp8(root, rng) if rng.random() < 0.75 else mutate(root, rng)


# -- token ids and loss masks, checksums made to match (issue 23, item 5) -----------------------


def mutate_tokens(root: str, rng: random.Random) -> str:
    """A token id outside [0, target_vocab_size) or a loss mask value other than 0/1 (the token rule,
    format.validate.token_problem) in one sample, its sample and tar checksums rewritten to match:
    bytes a writer could have written, which only the rule itself can refuse."""
    import xxhash

    vocab = json.load(open(CachePaths(root).manifest))["target_vocab_size"]
    path, index_path, index, raw = _random_shard(CachePaths(root), rng)
    entry = rng.choice(index["samples"])
    token = rng.randrange(entry[1])
    if rng.random() < 0.6:
        name, fmt, width = "input_ids", "<i", 4
        value = rng.choice(
            [vocab, vocab + 1, vocab + rng.randrange(1, 1 << 20), 2**31 - 1, -1, -vocab, -(2**31)]
        )
    else:
        name, fmt, width = "loss_mask", "<B", 1
        value = rng.choice([2, 3, 127, 128, 255])
    _, start, _ = _sample_tensors(bytes(raw), entry[3])[name]
    at = start + width * token
    raw[at : at + width] = struct.pack(fmt, value)
    entry[5] = xxhash.xxh3_64_intdigest(bytes(raw[entry[3] : entry[3] + entry[4]]))
    index["tar_xxh3"] = xxhash.xxh3_64_intdigest(bytes(raw))
    open(path, "wb").write(bytes(raw))
    json.dump(index, open(index_path, "w"))
    return f"tokens: sample {entry[0]} in {os.path.basename(path)}: {name}[{token}] = {value}"


# -- compressed samples: crafted frames, checksums made to match (issue 42) -------------------------


def _zstd_frame(data_size: int, rng: random.Random, declared: int | None = None, *, checksum: bool = True,
                zeros: bool = False) -> bytes:
    """A zstd frame of ``data_size`` zero (``zeros``, else either) or random bytes declaring ``declared``
    (default: its size; -1: none), built in pieces so that a bomb never sits in this process's memory."""
    import zstandard

    size = data_size if declared is None else declared
    packer = zstandard.ZstdCompressor(level=1, write_checksum=checksum, write_content_size=size >= 0)
    stream = packer.compressobj(size=max(size, 0) if size >= 0 else -1)
    fill = zeros or rng.random() < 0.5
    out, left = [], data_size
    while left:
        n = min(left, 1 << 20)
        out.append(stream.compress(bytes(n) if fill else rng.randbytes(n)))
        left -= n
    return b"".join(out) + stream.flush()


def _mutate_zstd(root: str, rng: random.Random) -> str:
    """One compressed sample's frame replaced by a hostile one of the same stored size (zero-filled after
    a shorter one), its sample and tar checksums rewritten to match: only the codec's checks can refuse it."""
    import xxhash

    from dspark_cache.format.geometry import SampleShape
    from dspark_cache.format.manifest import read_manifest

    shape = SampleShape.from_manifest(read_manifest(root))
    path, index_path, index, raw = _random_shard(CachePaths(root), rng)
    entry = rng.choice(index["samples"])
    offset, size = entry[3], entry[4]
    header = shape.header_size(entry[1], entry[0], offset, size)
    frame = bytes(raw[offset + header : offset + size])
    data = shape.data_size(entry[1])
    how = rng.choice(["bomb", "bomb", "no size", "no checksum", "wrong size", "random", "flip", "flip",
                      "truncated", "another sample's"])
    if how == "bomb":  # declares (and holds) far more than the sample: refused before a byte is decoded
        bad = _zstd_frame(rng.choice([1 << 28, 1 << 30, data * 64]), rng, zeros=True)
    elif how == "no size":
        bad = _zstd_frame(data, rng, -1)
    elif how == "no checksum":
        bad = _zstd_frame(data, rng, checksum=False)
    elif how == "wrong size":
        bad = _zstd_frame(data + rng.choice([-64, -1, 1, 64]), rng)
    elif how == "random":
        bad = rng.randbytes(len(frame))
    elif how == "flip":
        at = rng.randrange(len(frame))
        bad = frame[:at] + bytes([frame[at] ^ (1 << rng.randrange(8))]) + frame[at + 1 :]
    elif how == "truncated":
        bad = frame[: rng.randrange(len(frame))]
    else:  # a frame of the writer's whose size is this sample's, but not its bytes: its checksum differs
        bad = _zstd_frame(data, rng)
    if len(bad) > len(frame):
        bad = bad[: len(frame)]  # a longer frame cut to fit: refused all the same
    raw[offset + header : offset + size] = bad + bytes(len(frame) - len(bad))
    entry[5] = xxhash.xxh3_64_intdigest(bytes(raw[offset : offset + size]))
    index["tar_xxh3"] = xxhash.xxh3_64_intdigest(bytes(raw))
    open(path, "wb").write(bytes(raw))
    json.dump(index, open(index_path, "w"))
    return f"zstd: sample {entry[0]} in {os.path.basename(path)}: {how} frame"


# -- reading ----------------------------------------------------------------------------------


def run_case(root: str, original: dict, extra_readers=()) -> str:
    from dspark_cache.format.errors import CacheError
    from dspark_cache.verify import verify_cache

    outcomes = {}
    for name, read in (("open_cache", _read_open_cache), ("loader-native", _read_loader(True)),
                       ("loader-python", _read_loader(False)), *extra_readers):
        try:
            outcomes[name] = "same" if read(root, original) else "FAIL: different data"
        except CacheError as exc:
            outcomes[name] = "rejected" if root in str(exc) else f"FAIL: error without the file: {exc}"
        except Exception as exc:  # any other type is a defect: report it with its traceback
            outcomes[name] = f"FAIL: {type(exc).__name__}: {exc} | {traceback.format_exc(limit=3)[-400:]}"
    try:
        verified = verify_cache(root).ok
    except CacheError:
        verified = False
    except Exception as exc:
        return f"FAIL: verify raised {type(exc).__name__}: {exc}"
    failures = [f"{k}: {v}" for k, v in outcomes.items() if v.startswith("FAIL")]
    if failures:
        return "FAIL: " + " / ".join(failures)
    if verified and any(v == "rejected" for v in outcomes.values()):
        return f"FAIL: verify says OK but a reader rejected it ({outcomes})"
    return "rejected" if "rejected" in outcomes.values() else "same"


_KEYS = ("input_ids", "loss_mask", "target_hidden_states", "target_last_hidden_states")


def _same(sample: dict, want: dict) -> bool:
    import torch

    return all(torch.equal(sample[k], want[k]) for k in _KEYS)


def _read_open_cache(root: str, original: dict) -> bool:
    import dspark_cache

    with dspark_cache.open_cache(root) as cache:
        samples = {s["sample_id"]: s for s in cache.samples()}
    return samples.keys() == original.keys() and all(_same(samples[i], original[i]) for i in original)


def _read_open_cache_raw(root: str, original: dict) -> bool:
    """FP8 samples as stored (codes and scales), dequantised as the loader's default would."""
    import dspark_cache

    with dspark_cache.open_cache(root, dtype="raw") as cache:
        samples = {s["sample_id"]: dspark_cache.dequantize(s) for s in cache.samples()}
    return samples.keys() == original.keys() and all(_same(samples[i], original[i]) for i in original)


def _read_webdataset(root: str, original: dict) -> bool:
    """Every shard through plain WebDataset and our decoder, bounded by the manifest's vocabulary; the
    decoder's refusal comes wrapped in WebDataset's error, which carries the tar's url."""
    import functools

    import webdataset as wds

    from dspark_cache.format.manifest import read_manifest
    from dspark_cache.format.errors import CacheError
    from dspark_cache.format.wds import decode_dspark_arrays
    from dspark_cache.loader.tensors import sample_to_torch

    handler = functools.partial(decode_dspark_arrays, vocab_size=read_manifest(root).target_vocab_size)
    samples = {}
    try:
        for sample in wds.WebDataset(_tars(root), shardshuffle=False).decode(handler):
            got = sample["safetensors"]
            samples[got["sample_id"]] = sample_to_torch({k: got[k] for k in _KEYS})
    except wds.autodecode.DecodingError as exc:
        if isinstance(exc.__cause__, CacheError):  # the decoder names the member; WebDataset knows the tar
            raise CacheError(f"{exc.url} ({exc.key}): {exc.__cause__}") from exc
        raise

    return samples.keys() == original.keys() and all(_same(samples[i], original[i]) for i in original)


def _read_loader(native: bool):
    def read(root: str, original: dict) -> bool:
        import dspark_cache

        os.environ["DSPARK_NATIVE"] = "1" if native else "0"
        loader = dspark_cache.build_dataloader(root, batch_size=3, shuffle=False, num_workers=1, prefetch=1)
        seen = set()
        try:
            for batch in loader:
                for row, sample_id in enumerate(batch["sample_ids"].tolist()):
                    want = original.get(sample_id)
                    n = int(batch["attention_mask"][row].sum())
                    if want is None or n != want["input_ids"].shape[0]:
                        return False
                    got = {k: batch[k][row, :n] for k in _KEYS}
                    if not _same(got, {k: want[k].to(got[k].dtype) for k in _KEYS}):
                        return False
                    seen.add(sample_id)
        finally:
            loader.close()
        return seen == original.keys()

    return read


# Mutation families (the optional last argument) and the readers each adds to the common three.
FAMILIES = {"cache": mutate, "fp8": mutate_fp8, "tokens": mutate_tokens, "zstd": _mutate_zstd}
EXTRA_READERS = {"fp8": (("open_cache-raw", _read_open_cache_raw),),
                 "tokens": (("webdataset", _read_webdataset),), "zstd": (("webdataset", _read_webdataset),)}


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5]), *sys.argv[6:7])
