"""Torch tensors from the format's torch-free samples, where samples are handed to users.

``dspark_cache.format`` decodes a sample into numpy views tagged with their safetensors dtype
code (:class:`~dspark_cache.format.sample.StoredTensor`), so that tools which never hand out a
tensor (``dspark-verify``, the monitor) never import torch. Everything the loader (and NeMo's
path on top of it) returns goes through here: the same shapes and bytes as the blob, states
without a copy. One rule for token ids and loss masks everywhere a tensor is handed out (a
sample of ``open_cache``, WebDataset's decoder, a batch): int64, NeMo's dtype for both; the
blob stores them as int32 and uint8, and widening a few bytes per token costs nothing. FP8 states come with their scales; :func:`dequantize` applies them on any device,
to the same bits as the loader's batch filler.
"""

from __future__ import annotations

from typing import Any, Mapping, Sequence

import torch

from dspark_cache.format.sample import (
    FP8_MAX,
    HIDDEN,
    HIDDEN_SCALE,
    INPUT_IDS,
    LAST_HIDDEN,
    LAST_HIDDEN_SCALE,
    LOSS_MASK,
    TORCH_NAMES,
    StoredTensor,
    dequantize_arrays,
    fp8_bad_codes,
    fp8_bad_scales,
    fp8_code_reason,
    fp8_scale_reason,
)
from dspark_cache.format.wds import decode_dspark_arrays


def torch_dtype(code: str) -> torch.dtype:
    """The torch dtype of a safetensors code (``"BF16"`` -> ``torch.bfloat16``)."""
    return getattr(torch, TORCH_NAMES[code])


def to_torch(stored: StoredTensor) -> torch.Tensor:
    """A tensor sharing ``stored``'s memory (BF16's int16 bits are reinterpreted, not converted)."""
    return torch.from_numpy(stored.array).view(torch_dtype(stored.code))


def sample_to_torch(sample: Mapping[str, StoredTensor]) -> dict[str, torch.Tensor]:
    """:func:`to_torch` of every tensor of a decoded sample, token ids and loss mask as int64."""
    out = {name: to_torch(stored) for name, stored in sample.items()}
    for name in (INPUT_IDS, LOSS_MASK):
        if name in out:
            out[name] = out[name].to(torch.int64)
    return out


def select_layers(
    sample: Mapping[str, torch.Tensor], positions: Sequence[int], hidden_size: int
) -> dict[str, torch.Tensor]:
    """A sample's states (and raw FP8 scales) of the stored layers at ``positions``, in that order
    (a new tensor each: ``[L, len(positions) * H]``, ``[L, len(positions)]``). The final state is
    untouched: a sample always carries it, inside the stored states or beside them."""
    index = torch.as_tensor(list(positions), dtype=torch.long)
    states = sample[HIDDEN]
    out = {HIDDEN: states.unflatten(-1, (-1, hidden_size)).index_select(-2, index).flatten(-2)}
    if HIDDEN_SCALE in sample:
        out[HIDDEN_SCALE] = sample[HIDDEN_SCALE].index_select(-1, index)
    return out


def dequantize(batch: Mapping[str, Any], dtype: torch.dtype = torch.bfloat16) -> dict[str, Any]:
    """A batch (or sample) of FP8 states with their scales, as ``dtype`` states without them.

    Works on any device (``dspark_cache.dequantize(batch_on_gpu)``) for batches from
    ``build_dataloader(..., dtype="raw")`` or samples from ``open_cache(..., dtype="raw")``: each
    float8 value times its row's scale for its ``H`` columns, computed in float32 and rounded
    once more to ``dtype``, so a bf16 result equals the loader's own dequantisation bit for bit.
    Other keys pass through; a batch without scales is returned as it is.

    The FP8 rule (``format.sample.fp8_bad_scales`` / ``fp8_bad_codes``) is checked on the device first,
    at the cost of one synchronisation: a bad scale or a NaN/inf code raises ``ValueError`` instead of
    turning into NaN or inf states. A batch's pad positions are not checked (those ``attention_mask``
    marks, or without it those of scale 0).
    """
    out = dict(batch)
    if HIDDEN_SCALE not in batch:
        return out
    checks = []
    for name, scale_name in ((HIDDEN, HIDDEN_SCALE), (LAST_HIDDEN, LAST_HIDDEN_SCALE)):
        states, scales = batch[name], out.pop(scale_name).to(torch.float32)
        code, codes = _FP8_CODES[states.dtype], states.view(torch.uint8)
        real = _real(batch, scales)
        codes_bad = fp8_bad_codes(codes.unflatten(-1, (scales.shape[-1], -1)), code).any(-1) & real
        scales_bad = fp8_bad_scales(scales, code) & real
        if dtype not in (torch.bfloat16, torch.float32):  # a narrower dtype overflows sooner
            scales_bad |= ~(scales * FP8_MAX[code]).to(dtype).isfinite() & real
        checks.append((name, scales_bad, codes_bad))
        groups = states.unflatten(-1, (scales.shape[-1], -1)).to(torch.float32)
        out[name] = (groups * scales.unsqueeze(-1)).flatten(-2).to(dtype)
    if bool(torch.stack([bad.any() for _, s, c in checks for bad in (s, c)]).any()):  # the one host wait
        _refuse(checks, batch)
    return out


_FP8_CODES = {getattr(torch, TORCH_NAMES[code]): code for code in FP8_MAX}


def _real(batch: Mapping[str, Any], scales: torch.Tensor) -> torch.Tensor:
    """Where ``scales`` belong to real tokens."""
    if not _padded(batch):
        return torch.ones_like(scales, dtype=torch.bool)
    mask = batch.get("attention_mask")
    return (mask != 0).unsqueeze(-1).to(scales.device) if mask is not None else scales != 0


def _padded(batch: Mapping[str, Any]) -> bool:
    """A loader batch ``[B, S, ...]`` is zero-padded past each row's length; a sample ``[L, ...]`` is not."""
    return batch[HIDDEN].dim() == 3


def _refuse(checks: list, batch: Mapping[str, Any]) -> None:
    """Raise for the first bad position (after the device said there is one)."""
    ids = batch.get("sample_ids")
    for name, scales_bad, codes_bad in checks:
        for bad, reason in ((scales_bad, fp8_scale_reason), (codes_bad, fp8_code_reason)):
            where = torch.nonzero(bad)
            if len(where):
                at = where[0].tolist()
                token, column = (at[1], at[2]) if _padded(batch) else (at[0], at[1])
                sample = f" of sample {int(ids[at[0]])}" if ids is not None and _padded(batch) else ""
                raise ValueError(
                    f"dequantize: {name}{sample}: {reason(token, column)}. These states are damaged: run "
                    "dspark-verify on the cache they came from (dspark-verify --repair, then rerun "
                    "dspark-produce, recomputes them)"
                )


_OUT_CODES = {torch.bfloat16: "BF16", torch.float32: "F32"}


def decode_dspark_sample(key: str, data: bytes, *, dtype: torch.dtype | None = torch.bfloat16,
                         vocab_size: int | None = None) -> Any:
    """A WebDataset decoder handler: ``*.safetensors`` members into NeMo's per-sample tensors.

    Usage::

        import webdataset as wds
        from dspark_cache.loader.tensors import decode_dspark_sample
        for sample in wds.WebDataset(urls, shardshuffle=False).decode(decode_dspark_sample):
            sample["safetensors"]["target_hidden_states"]  # [L, len(ids) * H]

    An FP8 sample is dequantised to ``dtype`` (bf16 or float32; other samples keep their stored
    dtype); ``functools.partial(decode_dspark_sample, dtype=None)`` keeps it raw, with its scales.
    ``vocab_size`` (the manifest's ``target_vocab_size``) bounds the token ids, as in
    :func:`~dspark_cache.format.wds.decode_dspark_arrays`.
    Returns ``None`` for other members, which lets WebDataset try its other handlers.
    """
    if dtype is not None and dtype not in _OUT_CODES:
        raise ValueError(f"FP8 samples dequantise to torch.bfloat16 or torch.float32, not {dtype}")
    arrays = decode_dspark_arrays(key, data, dequantize=None, vocab_size=vocab_size)
    if arrays is None:
        return None
    sample_id = arrays.pop("sample_id")
    if dtype is not None:
        arrays = dequantize_arrays(arrays, _OUT_CODES[dtype])
    return {**sample_to_torch(arrays), "sample_id": sample_id}
