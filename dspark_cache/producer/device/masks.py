"""Attention masks for the target's forward that never wait for the device.

Left to itself, a Hugging Face decoder given no attention mask looks for packed sequences in its
position ids (``find_packed_sequence_indices``), whose ``if (...).all()`` copies a flag from the
device: the host waits on the device once per forward, so it can never queue more than one batch
ahead. Our batches are never packed (one sample per row, right-padded, causal), so we build the mask
mapping the model would build, with transformers' own functions for its attention
implementation, minus the packing check, and hand it to the model as a dict (which decoders of
transformers >= 4.56 take as is). Whether the model really accepts it is checked once per run
by :func:`masks_match`: a model that ignored or misread the mapping (or an attention
implementation where "no mask" would mean bidirectional) falls back to the model's own path.
"""

from __future__ import annotations

import inspect
import logging
from typing import Any, Callable

import torch

log = logging.getLogger(__name__)

FULL = "full_attention"
SLIDING = "sliding_attention"


def _mask_builders() -> dict[str, Callable[..., Any]] | None:
    try:
        from transformers.masking_utils import create_causal_mask, create_sliding_window_causal_mask
    except ImportError:  # transformers too old for mask mappings: the model's own path it is
        return None
    return {FULL: create_causal_mask, SLIDING: create_sliding_window_causal_mask}


def _call(builder: Callable[..., Any], config: Any, embeds: torch.Tensor) -> Any:
    """``builder`` for a causal, unpadded, uncached batch shaped like ``embeds``; argument names
    differ between transformers releases, so they are read from the signature. Of the cache's
    names only the one a release requires is passed: a release that renamed it (``past_key_values``
    -> ``cache``) keeps the old one as an optional keyword and warns when both are given."""
    params = inspect.signature(builder).parameters
    kwargs: dict[str, Any] = {"config": config, "attention_mask": None}
    kwargs["inputs_embeds" if "inputs_embeds" in params else "input_embeds"] = embeds
    for name in ("cache", "past_key_values", "position_ids"):
        if name in params and params[name].default is inspect.Parameter.empty:
            kwargs[name] = None
    if "cache_position" in params:
        kwargs["cache_position"] = torch.arange(embeds.shape[1], device=embeds.device)
    return builder(**kwargs)


class CausalMasks:
    """Builds the ``{layer type: mask}`` mapping for a ``[B, T]`` batch of one model."""

    def __init__(self, config: Any, dtype: torch.dtype) -> None:
        self.config = config
        self.dtype = dtype
        self.builders = _mask_builders()
        layer_types = getattr(config, "layer_types", None) or [FULL]
        self.kinds = sorted(set(layer_types))

    def probe_length(self) -> int:
        """Tokens for the one-time check: past the sliding window when the model has sliding
        layers (shorter, a sliding mask equals a full causal one and a wrong one would pass)."""
        window = getattr(self.config, "sliding_window", None) if SLIDING in self.kinds else None
        return 12 if not window else min(int(window) + 8, 1 << 13)

    @property
    def usable(self) -> bool:
        return self.builders is not None and all(kind in self.builders for kind in self.kinds)

    def mapping(self, batch: int, length: int, device: torch.device) -> dict[str, Any]:
        """The masks for a causal batch without padding: for sdpa and flash attention this is
        ``None`` (their causal kernels), for eager a ``[B, 1, T, T]`` mask built on the device."""
        assert self.builders is not None
        # Only shape, dtype and device of the embeddings are read: a zero-width view costs nothing.
        embeds = torch.empty((batch, length, 0), dtype=self.dtype, device=device)
        return {kind: _call(self.builders[kind], self.config, embeds) for kind in self.kinds}


def masks_match(base: torch.nn.Module, masks: CausalMasks, vocab_size: int, device: torch.device) -> bool:
    """One small forward with the model's own masks and one with ours: equal outputs mean the
    mapping is taken and means what we think (for every layer type and attention kernel; with
    sliding layers the probe is longer than the window, up to 8,192 tokens)."""
    if not masks.usable:
        return False
    length = masks.probe_length()
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(0, max(1, vocab_size), (2, length), generator=generator).to(device)
    try:
        with torch.inference_mode():
            theirs = base(input_ids=ids, use_cache=False).last_hidden_state
            ours = base(
                input_ids=ids, attention_mask=masks.mapping(2, length, device), use_cache=False
            ).last_hidden_state
    except Exception as exc:  # a model whose forward refuses a dict mask
        log.info("the target does not take a mask mapping (%s): using its own masks", exc)
        return False
    # Same kernels on the same inputs: equal up to rounding; a bidirectional or shifted mask
    # changes every output by far more than this.
    scale = float(theirs.float().abs().max()) or 1.0
    same = float((theirs.float() - ours.float()).abs().max()) <= 1e-3 * scale
    if not same:
        log.warning("the target reads the mask mapping differently from its own masks: using its own "
                    "(the host waiting on the device once per forward)")
    return same
