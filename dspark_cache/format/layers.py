"""NeMo's layer-id convention: the single place that maps layer ids to captured tensors.

``-1`` is the embedding output, ``i`` the output of decoder layer ``i`` (HF
``hidden_states[i + 1]``), and ``N - 1`` the post-final-norm state (HF ``hidden_states[N]``),
which is also ``target_last_hidden_states``. The final state is stored once: when ``N - 1`` is
among the ids, ``target_last_hidden_states`` is the last ``H`` columns of the stored
``target_hidden_states``.
"""

from __future__ import annotations

import numbers
from typing import Sequence

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



def draft_layer_union(num_layers: int, draft_depths: Sequence[int]) -> list[int]:
    """The layers a cache must hold to train drafters of each of ``draft_depths`` layers with
    NeMo's default spread (:func:`build_target_layer_ids`): the sorted union of their spreads."""
    if not draft_depths or any(depth < 1 for depth in draft_depths):
        raise ValueError(
            f"--for-draft-layers {list(draft_depths)}: give drafter depths of 1 or more, e.g. 1,2,3,5"
        )
    return sorted({i for depth in draft_depths for i in build_target_layer_ids(num_layers, depth)})


def layer_positions(
    stored: Sequence[int], wanted: Sequence[int], where: str = "the cache"
) -> tuple[int, ...]:
    """Where each of ``wanted`` (in the caller's order) lies among a cache's ``stored`` ids.

    Raises ``ValueError`` naming the ids the cache lacks (or repeats), and what to do.
    """
    odd = [i for i in wanted if not isinstance(i, numbers.Integral) or isinstance(i, bool)]
    if odd:
        raise ValueError(
            f"target_layer_ids {list(wanted)}: {odd} are not layer ids (integers, NeMo's convention)"
        )
    wanted = [int(i) for i in wanted]
    position = {layer: k for k, layer in enumerate(stored)}
    missing = [i for i in wanted if i not in position]
    repeated = sorted({i for i in wanted if wanted.count(i) > 1})
    if not wanted or missing or repeated:
        problem = ("no layer ids" if not wanted else f"layer ids {missing} that it does not hold" if missing
                   else f"layer ids {repeated} more than once")
        raise ValueError(
            f"target_layer_ids {wanted} asks {where} (layers {list(stored)}) for {problem}. Choose a "
            "subset of its layers, or produce a cache that holds them (dspark-produce "
            "--target-layer-ids, or --for-draft-layers for several drafter depths)"
        )
    return tuple(position[i] for i in wanted)
