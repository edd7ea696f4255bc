"""``build_dataloader``: one cache's loader (:mod:`.dataloader`) or a mixture's (:mod:`.mixture`)."""

from __future__ import annotations

import dataclasses
import inspect
import os
from typing import Any, Sequence

from dspark_cache.loader.config import LoaderConfig
from dspark_cache.loader.dataloader import DSparkLoader
from dspark_cache.loader.mixture import MixtureLoader
from dspark_cache.loader.sources import Source, as_mixture


def build_dataloader(cached_target_path: "str | os.PathLike | Source | Sequence[Source]", batch_size: int,
                     **kwargs: Any) -> DSparkLoader:
    """Batches of a dspark cache for one training rank (options: :class:`~.config.LoaderConfig`).

    ``cached_target_path``: a cache (directory or ``s3://`` URL), or a mixture of caches: a list of
    ``dspark_cache.Source(path, repeat=, choose=, proportion=)`` or a mixture file (``.json``,
    ``.yaml``; :mod:`.sources` states the weights' rules). A mixture's batches also carry
    ``source_ids`` ``[B]`` (each row's source, its index in the list); its sources must share
    the target, hidden size, the layers handed out and (``pad_to="seq_length"``) ``seq_length``.

    Keys: NeMo's ``input_ids``, ``loss_mask`` (int64 ``[B,S]``), ``target_hidden_states``
    ``[B,S,len(ids)*H]`` (``ids``: ``target_layer_ids``, default the cache's) and
    ``target_last_hidden_states`` ``[B,S,H]`` (cache dtype, zero-padded; an FP8
    cache's dequantised to ``dtype``, bf16 by default, while read; ``dtype="raw"`` hands out its
    float8 states plus ``target_hidden_states_scale`` ``[B,S,len(ids)]`` and
    ``target_last_hidden_states_scale`` ``[B,S,1]``: ``dspark_cache.dequantize(batch)``),
    plus ``attention_mask`` ``[B,S]``, ``sample_ids`` ``[B]`` and ``is_repeat`` ``[B]`` (True for
    the repeats that pad the last step when ``drop_last`` is off).

    ``num_workers`` is the number of reader threads of this process (default ``min(4, cpus)``; 0
    means one): batches are always read ahead off the training thread, and no worker processes
    are started. A negative value raises ``ValueError``.

    Every sample's xxh3 is checked the first time this process reads it (``verify="once"``, the
    default: later epochs re-read checked bytes from the page cache without hashing them);
    ``verify="always"`` checks every read. Each sample's header is checked on every read.

    Batch memory is recycled once nothing references a batch any more; a batch (or any view
    of it) that the caller keeps is never overwritten. Pinned batches (``pin_memory``, on by
    default where CUDA exists) come from CUDA's caching host allocator instead.
    """
    mixture = as_mixture(cached_target_path, kwargs.pop("epoch_size", None))
    if mixture is not None:
        return MixtureLoader(mixture, batch_size, **kwargs)
    return DSparkLoader(cached_target_path, batch_size, **kwargs)  # type: ignore[arg-type]


def _options_signature() -> inspect.Signature:
    """``build_dataloader``'s signature as ``help()`` and editors show it: every option of
    :class:`~.config.LoaderConfig` by name, with its default (the one list of them)."""
    params = [inspect.Parameter("cached_target_path", inspect.Parameter.POSITIONAL_OR_KEYWORD),
              inspect.Parameter("batch_size", inspect.Parameter.POSITIONAL_OR_KEYWORD, annotation="int")]
    for option in dataclasses.fields(LoaderConfig):
        if option.name != "batch_size":
            params.append(inspect.Parameter(option.name, inspect.Parameter.KEYWORD_ONLY,
                                            default=option.default, annotation=option.type))
    return inspect.Signature(params, return_annotation="DSparkLoader")


build_dataloader.__signature__ = _options_signature()  # type: ignore[attr-defined]
