"""Reading ``manifest.json``: a regular file of bounded size, decoded and checked for consistency."""

from __future__ import annotations

import msgspec

from dspark_cache.format.errors import CacheError, NotACacheError
from dspark_cache.format.files import read_regular
from dspark_cache.format.paths import CachePaths
from dspark_cache.format.schema import Manifest, decode_manifest
from dspark_cache.format.validate import MAX_MANIFEST_BYTES, check_manifest


def load_manifest(root: str) -> Manifest:
    """The manifest of the cache at ``root``; :class:`NotACacheError` when there is none."""
    paths = CachePaths(root)
    try:
        data = read_regular(paths.manifest, MAX_MANIFEST_BYTES)
    except (FileNotFoundError, NotADirectoryError) as exc:
        raise NotACacheError(
            f"{root} is not a dspark cache (no manifest.json); run dspark-produce --output-dir {root} first"
        ) from exc
    try:
        manifest = decode_manifest(data, paths.manifest)
    except msgspec.DecodeError as exc:
        raise CacheError(str(exc)) from exc
    check_manifest(manifest, paths.manifest)
    return manifest
