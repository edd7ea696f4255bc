"""A mixture's sources and their weights: how many samples each gives to an epoch.

The rules are mosaicml/streaming's ``Stream`` (``Stream.apply_weights``), so a recipe written for
it means the same here. Each :class:`Source` sets at most one of:

* ``repeat``: ``floor(repeat * n)`` samples per epoch (``n``: the source's samples); 2.0 doubles
  it, 0.5 halves it;
* ``choose``: exactly ``choose`` samples per epoch;
* ``proportion``: that share of the epoch. Either every source gives a proportion (relative
  weights) or none does (absolute weights: ``repeat``, ``choose`` or nothing, which means every
  sample once). Relative weights are normalised to sum to 1; the epoch holds ``epoch_size``
  samples (default: the sources' samples together), ``floor(epoch_size * p)`` from each source,
  and the few left over by rounding go one each to sources (of a share > 0) drawn without
  replacement with the seed (the same every epoch).

A source's count ``c`` becomes, each epoch, ``c // n`` copies of every one of its samples plus
``c % n`` distinct samples drawn without replacement with (seed, epoch, source index): counts
are exact and the same every epoch, and an up- or down-sampled source gives a different subset
each epoch. The mixture file (:func:`read_mixture`) is JSON, or YAML where PyYAML is installed
(``{"sources": [{"path": ..., "repeat": 2.0}, ...], "epoch_size": ...}``).
"""

from __future__ import annotations

import json
import math
import numbers
import os
from typing import Any, Sequence

import msgspec
import numpy as np

from dspark_cache.loader.order import seeded as _rng  # the order's salt: one rule for every draw

# Keys the draws are made with, beside the seed and epoch (and the order's own salt).
_TAG_SHORTFALL, _TAG_SUBSET = 0x4D495831, 0x4D495832
WEIGHTS = ("repeat", "choose", "proportion")


class Source(msgspec.Struct, forbid_unknown_fields=True, frozen=True):
    """One cache of a mixture (a directory or ``s3://bucket/prefix``) and at most one weight:
    ``Source(path, repeat=None, choose=None, proportion=None)``, as streaming's ``Stream``."""

    path: str
    repeat: float | None = None
    choose: int | None = None
    proportion: float | None = None

    def __post_init__(self) -> None:
        if isinstance(self.path, os.PathLike):
            msgspec.structs.force_setattr(self, "path", os.fspath(self.path))
        _check_source(self, f"Source({self.path!r})")
        for name in ("repeat", "proportion"):  # 2 and 2.0 are one weight (and one resume state)
            if getattr(self, name) is not None:
                msgspec.structs.force_setattr(self, name, float(getattr(self, name)))


class MixtureFile(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """A mixture file: its sources, in order (a batch's ``source_ids`` index this list)."""

    sources: list[Source]
    epoch_size: int | None = None  # relative weights only: samples per epoch (default: all of them)


def _check_source(source: Source, where: str) -> None:
    if not isinstance(source.path, str) or not source.path:
        raise ValueError(f"{where}: path must be a cache directory or an s3:// URL")
    given = [name for name in WEIGHTS if getattr(source, name) is not None]
    if len(given) > 1:
        raise ValueError(f"{where}: gives {' and '.join(given)}; give at most one of repeat, choose, "
                         "proportion (the others follow from it)")
    for name in given:
        value = getattr(source, name)
        whole = name == "choose"
        number = isinstance(value, int if whole else (int, float)) and not isinstance(value, bool)
        if not number or not math.isfinite(value) or value < 0:
            kind = "a whole number" if whole else "a number"
            raise ValueError(f"{where}: {name}={value!r} must be {kind} >= 0")


def read_mixture(path: str | os.PathLike) -> MixtureFile:
    """A mixture file, checked; relative paths in it are relative to the file's directory."""
    path = os.fspath(path)
    try:
        with open(path, "rb") as handle:
            data = handle.read()
    except OSError as exc:
        raise ValueError(f"mixture file {path}: {exc.strerror or exc}; give the path of a mixture file "
                         "(.json, .yaml) or of a cache directory") from None
    try:
        if path.endswith((".yaml", ".yml")):
            raw = _yaml(data, path)
        else:
            raw = json.loads(data)
        mixture = msgspec.convert(raw, MixtureFile, strict=False)
    except (ValueError, msgspec.ValidationError) as exc:
        raise ValueError(f"mixture file {path}: {exc}; it holds {{\"sources\": [{{\"path\": ..., \"repeat\": "
                         "...}, ...]} (README, Training on a mixture)") from None
    base = os.path.dirname(os.path.abspath(path))
    sources = [msgspec.structs.replace(s, path=s.path if "://" in s.path else os.path.join(base, s.path))
               for s in mixture.sources]
    for i, source in enumerate(sources):
        _check_source(source, f"mixture file {path}, source {i}")
    return MixtureFile(sources=sources, epoch_size=mixture.epoch_size)


def _yaml(data: bytes, path: str) -> Any:
    try:
        import yaml
    except ImportError:  # pragma: no cover - PyYAML comes with transformers
        raise ValueError(f"{path} is YAML, and PyYAML is not installed: pip install pyyaml, or write "
                         "it as JSON")
    try:
        return yaml.safe_load(data)
    except yaml.YAMLError as exc:
        raise ValueError(str(exc).replace("\n", " ")) from None


def is_mixture_file(path: object) -> bool:
    """A local path ending in .json, .yaml or .yml that is not a directory: a mixture file (one that
    does not exist is then named as such, not as a directory without a cache)."""
    if not isinstance(path, (str, os.PathLike)):
        return False
    path = os.fspath(path)
    return isinstance(path, str) and "://" not in path and path.endswith((".json", ".yaml", ".yml")) \
        and not os.path.isdir(path)


def as_mixture(spec: object, epoch_size: int | None = None) -> MixtureFile | None:
    """``build_dataloader``'s first argument as a mixture, or None for one cache."""
    if isinstance(spec, Source):
        spec = [spec]
    if isinstance(spec, (list, tuple)):
        if not spec:
            raise ValueError("a mixture needs at least one Source")
        bad = [i for i, s in enumerate(spec) if not isinstance(s, Source)]
        if bad:
            kind = type(spec[bad[0]]).__name__
            raise ValueError(f"mixture item {bad[0]} is {kind}, not dspark_cache.Source")
        return MixtureFile(sources=list(spec), epoch_size=epoch_size)
    if is_mixture_file(spec):
        mixture = read_mixture(spec)  # type: ignore[arg-type]
        if epoch_size is not None:
            mixture.epoch_size = epoch_size
        return mixture
    if epoch_size is not None:
        raise ValueError("epoch_size applies to a mixture of sources with proportions, not to one cache")
    return None


def epoch_counts(sources: Sequence[Source], sizes: Sequence[int], epoch_size: int | None,
                 seed: int) -> list[int]:
    """Samples each source gives to every epoch (``sizes``: each source's samples), as ``Stream``'s."""
    where = [f"source {i} ({s.path})" for i, s in enumerate(sources)]
    relative = [s.proportion is not None for s in sources]
    if any(relative) and not all(relative):
        first = relative.index(not relative[0])
        raise ValueError(f"{where[first]}: proportions are relative, repeat and choose absolute: give "
                         "every source a proportion, or none of them")
    for name, source, n in zip(where, sources, sizes):
        if n == 0 and ((source.choose or 0) > 0 or (source.proportion or 0) > 0):
            raise ValueError(f"{name} holds no samples; it cannot give any to an epoch")
    if all(relative):
        whole = isinstance(epoch_size, numbers.Integral) and not isinstance(epoch_size, bool)
        if epoch_size is not None and (not whole or epoch_size < 0):
            raise ValueError(f"epoch_size={epoch_size!r} must be a whole number >= 0")
        total = sum(sizes) if epoch_size is None else int(epoch_size)
        weights = np.array([s.proportion for s in sources], dtype=np.float64)
        if weights.sum() <= 0:
            raise ValueError("the sources' proportions sum to 0; give at least one a share > 0")
        weights /= weights.sum()
        counts = (total * weights).astype(np.int64)
        shortfall = int(total - counts.sum())
        # Rounding leftovers: one each to sources drawn without replacement (Stream.apply_weights),
        # among those with a share, so that a source given 0 stays empty.
        eligible = np.flatnonzero(weights > 0)
        picked = eligible[_rng(seed, _TAG_SHORTFALL).choice(len(eligible), shortfall, replace=False)]
        counts[picked] += 1
        return [int(c) for c in counts]
    if epoch_size is not None:
        raise ValueError("epoch_size is for relative weights (every source a proportion); repeat and choose "
                         "already fix the epoch's size")
    return [int(s.repeat * n) if s.repeat is not None else s.choose if s.choose is not None else n
            for s, n in zip(sources, sizes)]


def epoch_subset(count: int, size: int, seed: int, epoch: int, source: int) -> np.ndarray:
    """How many times each of a source's ``size`` samples (ascending sample id) enters this epoch:
    ``count // size`` each, plus one for ``count % size`` of them drawn without replacement."""
    times = np.full(size, count // size if size else 0, dtype=np.int64)
    rest = count % size if size else 0
    if rest:
        times[_rng(seed, epoch, _TAG_SUBSET, source).choice(size, rest, replace=False)] += 1
    return times
