"""NeMo's layer-id convention: the single place that maps layer ids to captured tensors.

``-1`` is the embedding output, ``i`` the output of decoder layer ``i`` (HF
``hidden_states[i + 1]``), and ``N - 1`` the post-final-norm state (HF ``hidden_states[N]``),
which is also ``target_last_hidden_states``. The final state is stored once: when ``N - 1`` is
among the ids, ``target_last_hidden_states`` is the last ``H`` columns of the stored
``target_hidden_states``.
"""

from __future__ import annotations

EMBEDDING_LAYER = -1


def build_target_layer_ids(num_layers: int, num_feature_layers: int) -> list[int]:
    """NeMo's default spread: ``num_feature_layers`` ids from 1 to ``N - 1`` (always ends there)."""
    last = num_layers - 1
    count = max(1, min(num_feature_layers, last))
    if count == 1:
        return [last]
    # round() is Python's banker's rounding, as in NeMo: the spreads must agree exactly.
    return sorted({round(1 + i * (last - 1) / (count - 1)) for i in range(count)})


def validate_target_layer_ids(layer_ids: list[int], num_layers: int) -> None:
    """Raise ``ValueError`` unless ids are non-empty, strictly increasing, in ``[-1, N-1]``."""
    if not layer_ids:
        raise ValueError("--target-layer-ids is empty; give at least one layer id")
    bad = [i for i in layer_ids if i < EMBEDDING_LAYER or i > num_layers - 1]
    if bad:
        raise ValueError(
            f"--target-layer-ids {bad} out of range: the target has {num_layers} decoder layers, "
            f"so ids must lie in [-1, {num_layers - 1}] (-1 = embeddings, {num_layers - 1} = "
            "final post-norm state)"
        )
    if any(b <= a for a, b in zip(layer_ids, layer_ids[1:])):
        raise ValueError(f"--target-layer-ids {layer_ids} must be strictly increasing")


def stores_last(layer_ids: list[int] | tuple[int, ...], num_layers: int) -> bool:
    """Whether the post-norm state needs its own tensor: only when ``N - 1`` is not the last id
    (otherwise it is one of the feature layers and is stored once, inside the hidden states)."""
    return not layer_ids or layer_ids[-1] != num_layers - 1

