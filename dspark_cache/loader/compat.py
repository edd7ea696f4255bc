"""What every source of a mixture must share: what the drafter sees (the loader's and NeMo's rule).

The target (its type, the fingerprint of the weights it was loaded from, vocabulary, hidden size,
layer count, tokenizer and pad token), the layers handed out (``target_layer_ids``, when training
names none, the same stored layers in every source) and, with ``pad_to="seq_length"``, the
sequence length. Storage may differ (bf16 or FP8, a codec, local or remote): what differs is
how a source is read, never what it hands out, and the states are handed out in one dtype.
"""

from __future__ import annotations

from typing import Sequence

from dspark_cache.format.errors import CacheError
from dspark_cache.format.schema import Manifest

# Manifest fields every source must agree on, whatever the training run.
TARGET_FIELDS = ("target_model_type", "target_fingerprint", "target_vocab_size", "hidden_size",
                 "num_hidden_layers", "tokenizer_sha256", "pad_token_id")


class MixtureMismatchError(CacheError):
    """Two sources of a mixture hand out different things; the message names the source and field."""


def check_sources(manifests: Sequence[Manifest], names: Sequence[str], *, layers_given: bool,
                  same_seq_length: bool) -> None:
    """Raise for the first source (after the first) that differs from source 0 in a shared field."""
    fields = list(TARGET_FIELDS)
    if not layers_given:
        fields.append("target_layer_ids")
    if same_seq_length:
        fields.append("seq_length")
    first = manifests[0]
    for name, m in zip(names[1:], manifests[1:]):
        for field in fields:
            have, want = getattr(m, field), getattr(first, field)
            if have != want:
                raise MixtureMismatchError(f"{name}: {field} is {have!r} but {names[0]} has {want!r}; "
                                           f"{_advice(field)}")


def check_handed_out(codes: Sequence[str], names: Sequence[str]) -> None:
    """Every source hands out its states in one dtype (``codes``: each source's dtype code)."""
    for name, code in zip(names[1:], codes[1:]):
        if code != codes[0]:
            raise MixtureMismatchError(f"{name}: dtype: it hands out {code} states but {names[0]} hands out "
                                       f"{codes[0]}; FP8 sources are dequantised to the others' dtype "
                                       "(dtype='bf16' or 'fp32'), other dtypes are handed out as stored: "
                                       "mix caches that store the same dtype, or FP8 ones")


def _advice(field: str) -> str:
    if field == "target_layer_ids":
        return ("pass target_layer_ids= with layers every source holds, or mix caches that captured the same "
                "layers")
    if field == "seq_length":
        return "pad_to='longest' mixes caches of different seq_length; pad_to='seq_length' needs one"
    return "every source of a mixture must be produced from the same target (and tokenizer)"
