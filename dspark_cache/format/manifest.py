"""``manifest.json``: the one reader (a regular file of bounded size, decoded, its fields checked
against each other) and the one writer (indented, sorted, replaced atomically)."""

from __future__ import annotations

import uuid
from typing import Literal, overload

import msgspec

from dspark_cache.format.atomic import atomic_write_bytes
from dspark_cache.format.errors import CacheError, IncompleteCacheError, NotACacheError
from dspark_cache.format.files import read_regular
from dspark_cache.format.paths import CachePaths
from dspark_cache.format.schema import Manifest, decode_manifest, encode_json
from dspark_cache.format.validate import MAX_MANIFEST_BYTES, check_manifest


class ManifestDecodeError(CacheError):
    """``manifest.json`` does not decode as ours (damaged, NeMo's layout, an older version); the
    message says which and what to do."""


@overload
def read_manifest(root: str, *, missing_ok: Literal[False] = False, allow_incomplete: bool = False,
                  checked: bool = True, within: str | None = None, shown: str | None = None) -> Manifest: ...


@overload
def read_manifest(
    root: str,
    *,
    missing_ok: bool,
    allow_incomplete: bool = False,
    checked: bool = True,
    within: str | None = None,
    shown: str | None = None,
) -> Manifest | None: ...


def read_manifest(
    root: str,
    *,
    missing_ok: bool = False,
    allow_incomplete: bool = False,
    checked: bool = True,
    within: str | None = None,
    shown: str | None = None,
) -> Manifest | None:
    """The manifest of the cache at ``root``.

    No manifest raises :class:`NotACacheError`, or gives ``None`` with ``missing_ok``. An incomplete
    cache is refused (:class:`IncompleteCacheError`) unless ``allow_incomplete``. ``checked=False``
    skips the check of its fields against each other, for a caller that reports each problem itself
    (``validate.manifest_problems``); ``within`` confines the open to that directory (``files``);
    ``shown`` is what messages call the cache (a remote cache's URL; ``root`` is then its local copy).
    """
    paths = CachePaths(root)
    name = shown or root
    try:
        data = read_regular(paths.manifest, MAX_MANIFEST_BYTES, within)
    except (FileNotFoundError, NotADirectoryError) as exc:
        if missing_ok:
            return None
        raise NotACacheError(
            f"{name} is not a dspark cache (no manifest.json); run dspark-produce --output-dir {name} first"
        ) from exc
    try:
        manifest = decode_manifest(data, paths.manifest)
    except msgspec.DecodeError as exc:
        raise ManifestDecodeError(str(exc)) from exc
    if checked:
        check_manifest(manifest, paths.manifest)
    if not manifest.complete and not allow_incomplete:
        raise IncompleteCacheError(
            f"{name} is incomplete: the producer has not finished (or was stopped). Rerun "
            "dspark-produce with the same arguments to finish it, or read it while it grows "
            "with follow=True"
        )
    return manifest


def write_manifest(paths: CachePaths, manifest: Manifest) -> None:
    """Replace ``manifest.json`` atomically: a reader sees the old one or the new one, whole."""
    atomic_write_bytes(paths.manifest, encode_json(manifest, pretty=True))


def adopt_cache_id(manifest: Manifest, existing: Manifest | None) -> None:
    """A run that starts a cache (a fresh directory, or ``--overwrite``) gives it a new ``cache_id``; a
    resume keeps the existing one, so readers of the cache it continues keep reading it."""
    manifest.cache_id = existing.cache_id if existing is not None else uuid.uuid4().hex
