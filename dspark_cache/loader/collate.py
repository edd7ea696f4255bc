"""Pad unpadded samples into NeMo's batch contract (zeros: finite, so NaN * 0 never happens)."""

from __future__ import annotations

import torch


def collate_padded(samples: list[dict], seq_length: int, pad_token_id: int = 0) -> dict[str, torch.Tensor]:
    """``input_ids``/``loss_mask`` int64 ``[B,S]``; hidden states ``[B,S,...]`` zero-padded."""
    b = len(samples)
    first = samples[0]
    hidden = first["target_hidden_states"]
    last = first["target_last_hidden_states"]
    batch = {
        "input_ids": torch.full((b, seq_length), pad_token_id, dtype=torch.int64),
        "loss_mask": torch.zeros((b, seq_length), dtype=torch.int64),
        "target_hidden_states": torch.zeros((b, seq_length, hidden.shape[-1]), dtype=hidden.dtype),
        "target_last_hidden_states": torch.zeros((b, seq_length, last.shape[-1]), dtype=last.dtype),
    }
    for row, sample in enumerate(samples):
        n = min(int(sample["input_ids"].shape[0]), seq_length)
        for key in batch:
            batch[key][row, :n] = sample[key][:n]
    return batch
