"""NeMo's consumer checks: the cache must match the training configuration, field by field."""

from __future__ import annotations

from typing import Any, Sequence

from dspark_cache.format.errors import CacheError
from dspark_cache.format.sample import CACHE_DTYPES
from dspark_cache.format.schema import FP8_DTYPES, Manifest

# expect key -> manifest field (aliases accepted for the names training configs use)
_FIELDS = {
    "target_model_type": "target_model_type",
    "model_type": "target_model_type",
    "target_vocab_size": "target_vocab_size",
    "vocab_size": "target_vocab_size",
    "hidden_size": "hidden_size",
    "num_hidden_layers": "num_hidden_layers",
    "seq_length": "seq_length",
    "dtype": "dtype",
    "target_layer_ids": "target_layer_ids",
    "target_hidden_dim": "target_hidden_dim",
    "target_last_hidden_dim": "target_last_hidden_dim",
}
_FLOAT_DTYPES = ("bf16", "fp16", "fp32", *FP8_DTYPES)
_NAME_OF_CODE = {code: name for name, code in CACHE_DTYPES.items()}


class CacheMismatchError(CacheError):
    """The cache was produced for another target or configuration than this training run."""


def check_expectations(manifest: Manifest, expect: dict[str, Any], where: str = "the cache",
                       delivered: str | None = None, layers: Sequence[int] | None = None) -> None:
    """Raise one error listing every field that differs (with both values), NeMo's nine checks.

    ``expect`` may hold ``compute_dtype`` (the trainer's, a name like ``"fp32"`` or a torch dtype):
    an fp32 trainer needs fp32 states (an fp32 cache, or an FP8 one dequantised to fp32).
    ``target_layer_ids`` and ``hidden_size`` also imply the two hidden dimensions. ``delivered`` is
    the code of the states the loader hands out (default: the stored dtype); ``expect["dtype"]``
    may name either. ``layers``: the layer ids handed out (default: the cache's), which
    ``expect["target_layer_ids"]`` and ``expect["target_hidden_dim"]`` are compared with.
    """
    layers = list(manifest.target_layer_ids if layers is None else layers)
    handed_out = _NAME_OF_CODE.get(delivered or "", manifest.dtype)
    unknown = set(expect) - set(_FIELDS) - {"compute_dtype"}
    if unknown:
        raise ValueError(
            f"unknown expect keys {sorted(unknown)}; known: {sorted(set(_FIELDS) | {'compute_dtype'})}"
        )
    problems: list[str] = []

    delivered_fields = {"target_layer_ids": layers, "target_hidden_dim": len(layers) * manifest.hidden_size}

    def differ(field: str, want: Any) -> None:
        have = delivered_fields.get(field, getattr(manifest, field))
        if have != want:
            hint = ""
            if field == "target_layer_ids" and set(want) <= set(manifest.target_layer_ids):
                hint = f" (it holds {list(manifest.target_layer_ids)}: pass target_layer_ids={list(want)} to take them)"
            what = (
                "the loader hands out"
                if field in delivered_fields and layers != list(manifest.target_layer_ids)
                else "the cache has"
            )
            problems.append(f"{field}: {what} {have!r}, training expects {want!r}{hint}")

    for key, want in expect.items():
        if key == "compute_dtype" or (key == "dtype" and want == handed_out):
            continue
        differ(_FIELDS[key], list(want) if key == "target_layer_ids" else want)
    ids = expect.get("target_layer_ids")
    hidden = expect.get("hidden_size", manifest.hidden_size)
    if ids is not None and "target_hidden_dim" not in expect:
        differ("target_hidden_dim", hidden * len(ids))
    if "hidden_size" in expect and "target_last_hidden_dim" not in expect:
        differ("target_last_hidden_dim", hidden)
    if manifest.dtype not in _FLOAT_DTYPES:
        problems.append(f"dtype: the cache has {manifest.dtype!r}, not one of {_FLOAT_DTYPES}")
    compute = _dtype_name(expect.get("compute_dtype"))
    if compute == "fp32" and handed_out != "fp32":
        fix = "pass dtype='fp32' to dequantise it to fp32" if manifest.dtype in FP8_DTYPES else \
            "CPU training needs an fp32 cache"
        problems.append(
            f"dtype: the loader hands out {handed_out!r} states (cache {manifest.dtype!r}) but training "
            f"computes in fp32 ({fix})"
        )
    if problems:
        raise CacheMismatchError(
            f"{where} does not match this training run:\n  " + "\n  ".join(problems)
            + "\nProduce a cache with the training run's target and settings, or fix the training config."
        )


def _dtype_name(dtype: Any) -> str | None:
    """``"fp32"`` for ``torch.float32``, ``"float32"`` or ``"fp32"``; names pass through."""
    if dtype is None:
        return None
    name = str(dtype).removeprefix("torch.")
    return {"float32": "fp32", "float": "fp32", "bfloat16": "bf16", "float16": "fp16", "half": "fp16"}.get(
        name, name
    )
