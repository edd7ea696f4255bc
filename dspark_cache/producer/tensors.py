"""The producer's side of the format's torch-free contract: torch dtypes and tensor bytes.

``dspark_cache.format`` names dtypes by safetensors codes and writes plain buffers, so that
readers which never touch a tensor (``dspark-verify``, the monitor) never import torch. The
producer holds torch tensors; this module converts them right where they meet the format.
"""

from __future__ import annotations

from typing import Mapping

import numpy as np
import torch

from dspark_cache.format.sample import TORCH_NAMES

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
