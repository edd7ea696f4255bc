"""The four cache calls of NeMo 0.7.0's ``train_dspark`` recipe, with NeMo's signatures and types.

Each call looks at the directory it is given: a NeMo cache is handled exactly as NeMo's
original would handle it (:mod:`.nemo_format`), a dspark cache through our loader. Errors keep NeMo's
types (``FileNotFoundError`` for a missing cache, ``ValueError`` for an unusable one), so code
that catches them keeps working; the messages say what to do.

An FP8 dspark cache is dequantised by the loader to the dtype the recipe computes in (fp32 on
CPU, bf16 on CUDA: NeMo's own rule), and its manifest reports that dtype (the stored one as
``stored_dtype``), so NeMo's checks see a cache of the dtype training receives.

One dspark cache can train drafters of several depths: when the recipe's ``target_layer_ids``
(NeMo derives them from the drafter's depth) are a subset of the cache's layers, the manifest
check accepts it and remembers the subset for that cache, and the dataloader built next for it
hands out exactly those layers' states, in the recipe's order (NeMo's recipe passes no layers to
its dataloader call, so the check is where the recipe says which it wants).
"""

from __future__ import annotations

import logging
import os
from types import SimpleNamespace
from typing import Any

import msgspec
import torch
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler

from dspark_cache.format.errors import CacheError, NotACacheError
from dspark_cache.format.layers import layer_positions
from dspark_cache.format.paths import CachePaths
from dspark_cache.format.manifest import read_manifest as read_dspark_manifest
from dspark_cache.format.schema import FP8_DTYPES
from dspark_cache.nemo import nemo_format
from dspark_cache.loader.sources import is_mixture_file, read_mixture
from dspark_cache.nemo.dataset import DSparkMapDataset, collate
from dspark_cache.nemo.mixture import MixtureMapDataset, mixture_id, mixture_manifest, source_manifests
from dspark_cache.nemo.readahead import ReadAheadDataLoader

log = logging.getLogger(__name__)
# The layers each dspark cache's dataloader hands out, as the recipe's manifest check asked: by
# cache location, with the cache id the check saw (a cache re-produced there since is not that one).
_RECIPE_LAYERS: dict[str, tuple[str | None, tuple[int, ...]]] = {}


def _cache_key(cache_dir: str) -> str:
    cache_dir = os.fspath(cache_dir)
    return cache_dir.rstrip("/") if "://" in cache_dir else os.path.realpath(cache_dir)


def _recipe_layers(cache_dir: str, cache_id: str | None) -> tuple[int, ...] | None:
    """The layers the recipe's check asked of this cache, or None (all of them)."""
    known = _RECIPE_LAYERS.get(_cache_key(cache_dir))
    if known is None or known[0] != cache_id:
        return None
    return known[1]


def read_manifest(cache_dir: str, allow_incomplete: bool = False) -> dict[str, Any]:
    """NeMo's ``read_manifest``: the manifest as a dict with every field NeMo writes (same names
    and types; ours come along), refusing an incomplete cache unless ``allow_incomplete``."""
    cache_dir = os.fspath(cache_dir)
    if is_mixture_file(cache_dir):
        with _nemo_errors():
            return mixture_manifest(cache_dir, recipe_dtype)
    if nemo_format.is_nemo_cache(cache_dir):
        return nemo_format.read_manifest(cache_dir, allow_incomplete=allow_incomplete)
    with _nemo_errors():
        manifest = read_dspark_manifest(cache_dir, allow_incomplete=allow_incomplete)
    fields = {**nemo_format.MANIFEST_DEFAULTS, **msgspec.to_builtins(manifest)}
    delivered = recipe_dtype(manifest.dtype)
    if delivered is not None:  # what the dataloader hands out; NeMo validates this
        fields.update(dtype=delivered, stored_dtype=manifest.dtype)
    return fields


def recipe_dtype(stored: str) -> str | None:
    """The dtype an FP8 cache (``stored``) is dequantised to for the recipe, which computes in
    bf16 on CUDA and fp32 elsewhere; ``None`` for any other cache (handed out as stored)."""
    if stored not in FP8_DTYPES:
        return None
    return "bf16" if torch.cuda.is_available() else "fp32"


def read_target_weight_modules(cache_dir: str) -> tuple[SimpleNamespace, SimpleNamespace]:
    """NeMo's ``read_target_weight_modules``: ``(embed_tokens, lm_head)`` objects exposing ``.weight``."""
    cache_dir = os.fspath(cache_dir)
    if is_mixture_file(cache_dir):  # every source was made from one target: the first's weights
        cache_dir = read_mixture(cache_dir).sources[0].path
    if nemo_format.is_nemo_cache(cache_dir):
        embed, head = nemo_format.read_target_weights(nemo_format.target_weights_path(cache_dir),
                                                      *nemo_format.weight_shape(cache_dir))
    else:
        # an unreadable manifest: FileNotFoundError / ValueError, as NeMo's callers expect
        with _nemo_errors():
            manifest = read_dspark_manifest(cache_dir, allow_incomplete=True)
        embed, head = nemo_format.read_target_weights(CachePaths(cache_dir).target_weights,
                                                      manifest.target_vocab_size, manifest.hidden_size,
                                                      manifest.target_weights_xxh3)
    return SimpleNamespace(weight=embed), SimpleNamespace(weight=head)


def build_cached_dspark_dataloader(*, cache_dir: str, batch_size: int, shuffle: bool, num_workers: int = 0,
                                   distributed: bool = False) -> DataLoader:
    """NeMo's ``build_cached_dspark_dataloader``: the same ``DataLoader`` and sampler NeMo builds,
    so batches come in NeMo's order and torch's global RNG is drawn exactly as NeMo draws it.

    Batches hold NeMo's four keys, padded to the manifest's ``seq_length`` (``input_ids`` with the
    pad token, the rest with zeros); the states of the layers the recipe's manifest check asked for
    (all the cache's unless that check saw a subset). A dspark cache is read a whole batch at a time, checksummed
    (an FP8 one dequantised to :func:`recipe_dtype` as it is read).
    ``num_workers`` are ``DataLoader`` worker processes, as in NeMo. With 0 (NeMo's default) batches
    are read in the training process, the next one by the dataset's reader thread while training
    works on the current one; with ``n > 0`` torch forks ``n`` workers, each opening the cache with
    its own reader thread. A negative value raises ``ValueError`` before the cache is opened.
    """
    if num_workers < 0:
        raise ValueError(f"num_workers={num_workers}: it is the number of DataLoader worker processes, 0 or "
                         "more (0 reads in the training process, the next batch ahead on a thread)")
    cache_dir = os.fspath(cache_dir)
    if is_mixture_file(cache_dir):
        with _nemo_errors():
            manifests = source_manifests(read_mixture(cache_dir))
            layers = _recipe_layers(cache_dir, mixture_id(manifests))
            fp8 = [m.dtype for m in manifests if m.dtype in FP8_DTYPES]
            dataset = MixtureMapDataset(cache_dir, batch_size=batch_size, target_layer_ids=layers,
                                        dtype=recipe_dtype(fp8[0]) if fp8 else None)
        collate_fn = collate
    elif nemo_format.is_nemo_cache(cache_dir):
        dataset = nemo_format.NemoCacheDataset(cache_dir)
        collate_fn = nemo_format.stack_samples
    else:
        with _nemo_errors():
            manifest = read_dspark_manifest(cache_dir)
            layers = _recipe_layers(cache_dir, manifest.cache_id)
            dataset = DSparkMapDataset(cache_dir, batch_size=batch_size, dtype=recipe_dtype(manifest.dtype),
                                       target_layer_ids=layers)
        if layers is not None:
            log.info("DSpark cache at %s: the dataloader hands out layers %s of %s", cache_dir, list(layers),
                     manifest.target_layer_ids)
        collate_fn = collate
    sampler = DistributedSampler(dataset, shuffle=shuffle) if distributed else None  # type: ignore[arg-type]
    return ReadAheadDataLoader(
        dataset,
        batch_size=batch_size,
        sampler=sampler,
        shuffle=shuffle and sampler is None,
        num_workers=num_workers,
        pin_memory=torch.cuda.is_available(),
        collate_fn=collate_fn,
        drop_last=False,
    )


def validate_cached_dspark_manifest(cache_dir: str, manifest: dict[str, Any], target_config: Any,
                                    target_layer_ids: list[int], *, target_model: str, target_model_type: str,
                                    seq_length: int, compute_dtype: torch.dtype) -> None:
    """NeMo's ``_validate_cached_dspark_manifest``: the cache must fit the configured target and draft.

    A different ``target_model`` string only warns (paths differ across machines); every
    structural field raises ``ValueError``. CPU training (fp32) needs an fp32 cache. A dspark cache
    may hold more layers than ``target_layer_ids``: any subset is accepted, and the next dataloader
    built for this cache hands out that subset (a NeMo cache must match exactly, as in NeMo).
    """
    if str(manifest["target_model"]) != str(target_model):
        log.warning(
            "DSpark cache at %s was built for target_model=%r, but this run configured target_model=%r. "
            "Continuing because raw paths can differ across machines; structural cache fields will still "
            "be validated.",
            cache_dir,
            manifest["target_model"],
            target_model,
        )
    hidden_size = int(target_config.hidden_size)
    recorded = [int(x) for x in manifest["target_layer_ids"]]
    wanted = [int(x) for x in target_layer_ids]
    ours = not nemo_format.is_nemo_cache(cache_dir)
    subset = ours and set(wanted) <= set(recorded) and wanted != recorded
    if subset:  # the loader's own rule, named now: no id twice, none missing
        layer_positions(recorded, wanted, where=f"the DSpark cache at {cache_dir}")
    # A subset is checked against the cache's own layers; the loader then hands out the subset.
    expected_hidden_dim = hidden_size * len(recorded if subset else wanted)
    checks = (
        ("target_model_type", str(manifest["target_model_type"]), str(target_model_type)),
        ("target_vocab_size", int(manifest["target_vocab_size"]), int(target_config.vocab_size)),
        ("hidden_size", int(manifest["hidden_size"]), hidden_size),
        ("num_hidden_layers", int(manifest["num_hidden_layers"]), int(target_config.num_hidden_layers)),
        ("seq_length", int(manifest["seq_length"]), int(seq_length)),
    )
    for field, have, want in checks:
        if have != want:
            raise ValueError(f"DSpark cache at {cache_dir} was built for {field}={have!r}, but this run has "
                             f"{field}={want!r}. Use a cache produced for this target and seq_length, or fix "
                             "the config.")
    cache_dtype = nemo_format.DTYPES.get(str(manifest["dtype"]))
    if cache_dtype is None:
        raise ValueError(f"DSpark cache at {cache_dir} has unsupported dtype={manifest['dtype']!r}; "
                         f"produce it with --dtype one of {sorted(nemo_format.DTYPES)}.")
    if compute_dtype == torch.float32 and cache_dtype != torch.float32:
        raise ValueError(
            f"DSpark cache at {cache_dir} stores dtype={manifest['dtype']}, but CPU cached training "
            "requires fp32 cache tensors. Regenerate with --dtype fp32 or train on CUDA."
        )

    def check_layers() -> None:
        if recorded != wanted and not subset:
            holds = "holds" if ours else "was built for"
            raise ValueError(
                f"DSpark cache at {cache_dir} {holds} target_layer_ids={recorded}, but this run "
                f"requested target_layer_ids={wanted}. Set recipe_args.target_layer_ids to "
                + (
                    "a subset of the cache's, or produce a cache that holds this run's (dspark-produce "
                    "--for-draft-layers captures the layers of several drafter depths in one cache)."
                    if ours
                    else "the cache's, or produce a cache with this run's."
                )
            )

    if ours:  # which layers are missing says more than the dimension they would have made
        check_layers()
    dims = (
        ("target_hidden_dim", int(manifest["target_hidden_dim"]), expected_hidden_dim),
        ("target_last_hidden_dim", int(manifest["target_last_hidden_dim"]), hidden_size),
    )
    for field, have, want in dims:
        if have != want:
            raise ValueError(f"DSpark cache at {cache_dir} has {field}={have}, but the configured target and "
                             f"layers need {want} (hidden_size {hidden_size} x {want // hidden_size} target "
                             "layers for the first). Produce the cache with this run's target_layer_ids.")
    check_layers()
    if ours:
        _RECIPE_LAYERS[_cache_key(cache_dir)] = (manifest.get("cache_id"), tuple(wanted))
        if subset:
            log.info(
                "DSpark cache at %s holds layers %s; training on %s of them", cache_dir, recorded, wanted
            )


class _nemo_errors:
    """Re-raise our cache errors as the exception types NeMo's callers expect."""

    def __enter__(self) -> None:
        return None

    def __exit__(self, kind: type | None, exc: BaseException | None, tb: Any) -> bool:
        if isinstance(exc, NotACacheError):
            raise FileNotFoundError(str(exc)) from exc
        if isinstance(exc, CacheError):
            raise ValueError(str(exc)) from exc
        return False
