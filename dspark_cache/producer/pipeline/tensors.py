"""The producer's side of the format's torch-free contract: torch dtypes, FP8 and tensor bytes.

``dspark_cache.format`` names dtypes by safetensors codes and writes plain buffers, so that
readers which never touch a tensor (``dspark-verify``, the monitor) never import torch. The
producer holds torch tensors; this module converts them right where they meet the format, and
quantises FP8 caches' states (:func:`quantize_fp8`) on the device that computed them.
"""

from __future__ import annotations

from typing import Mapping

import numpy as np
import torch

from dspark_cache.format.sample import FP8_MAX, TORCH_NAMES

# The smallest positive normal float32: the scale of an all-zero row (its bytes are zeros, so it
# dequantises to exact zeros) and the floor of every scale (a row of subnormals must not divide
# by an underflowed zero).
_MIN_SCALE = torch.finfo(torch.float32).tiny

_CODES = {getattr(torch, name): code for code, name in TORCH_NAMES.items()}


def torch_dtype(dtype: str | torch.dtype) -> torch.dtype:
    """The torch dtype of a safetensors code (``"BF16"``); a torch dtype is returned as is."""
    return dtype if isinstance(dtype, torch.dtype) else getattr(torch, TORCH_NAMES[dtype])


def dtype_code(dtype: torch.dtype) -> str:
    """The safetensors code of a torch dtype (``torch.bfloat16`` -> ``"BF16"``)."""
    try:
        return _CODES[dtype]
    except KeyError:
        raise ValueError(f"dtype {dtype} has no safetensors code in this format") from None


def byte_view(tensor: torch.Tensor) -> np.ndarray:
    """A CPU tensor's bytes as a flat uint8 numpy array: a view, copied only if not contiguous."""
    if tensor.numel() == 0:  # torch refuses byte views of some empty tensors (stride 0)
        return np.empty(0, dtype=np.uint8)
    return tensor.contiguous().reshape(-1).view(torch.uint8).numpy()


def byte_views(tensors: Mapping[str, torch.Tensor]) -> dict[str, np.ndarray]:
    """:func:`byte_view` of every tensor, for ``ShardWriter.append``."""
    return {name: byte_view(tensor) for name, tensor in tensors.items()}


def quantize_fp8(states: torch.Tensor, group: int, code: str) -> tuple[torch.Tensor, torch.Tensor]:
    """``[..., k * group]`` states as float8 ``code`` plus ``[..., k]`` float32 scales, on their device.

    Each run of ``group`` columns of a row (one captured layer of one token) gets
    ``scale = max|x| / FP8_MAX`` and is stored as ``x / scale``, clamped to the format's finite
    range (saturating: never inf or NaN from finite input), so ``value = fp8 * scale``. Layers
    are done one at a time so that the float32 temporaries stay one layer in size. Non-finite
    input gives a non-finite scale: callers drop such samples (the finite check runs first).
    """
    top = FP8_MAX[code]
    if states.shape[-1] % group:
        raise ValueError(f"states of width {states.shape[-1]} are not whole groups of {group} columns")
    out = torch.empty(states.shape, dtype=torch_dtype(code), device=states.device)
    scales = torch.empty(
        (*states.shape[:-1], states.shape[-1] // group), dtype=torch.float32, device=states.device
    )
    source, target = states.unflatten(-1, (-1, group)), out.unflatten(-1, (-1, group))
    for k in range(scales.shape[-1]):
        part = source[..., k, :].float()  # the input itself when it is float32: never written to
        scale = part.abs().amax(-1).div_(top).clamp_min_(_MIN_SCALE)
        scales[..., k] = scale
        target[..., k, :] = (part / scale.unsqueeze(-1)).clamp_(-top, top)
    return out, scales
