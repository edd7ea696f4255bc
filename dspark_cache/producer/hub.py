"""The Hugging Face hub, asked once: a hub id (the target or a dataset) is resolved with one request
without retries; when the hub cannot be reached, or ``HF_HUB_OFFLINE`` is set, the run works from the
local cache from then on.

huggingface_hub and datasets retry an unreachable endpoint for every file they look up (half a minute
and a warning per try), and a run makes many look-ups: one failed request is enough to know.
"""

from __future__ import annotations

import os
import sys
from typing import Any, Callable, TypeVar

HUB_TIMEOUT_S = 10.0
OFFLINE = "HF_HUB_OFFLINE is set"  # the reason ask_hub gives when the user chose to work offline
T = TypeVar("T")


class HubRefusal(Exception):
    """The hub answered and said no (no such repository, gated, unauthorised)."""


def first_line(exc: BaseException) -> str:
    """An exception's message on one line (transformers', datasets' and the hub's run over several)."""
    lines = str(exc).strip().splitlines()
    return lines[0] if lines else type(exc).__name__


def ask_hub(query: Callable[[Any], T]) -> tuple[T | None, str]:
    """``query(HfApi())`` with its answer, or ``(None, why)`` when offline or the hub cannot be reached
    (the process then works offline: :func:`work_offline`). Raises :class:`HubRefusal` when the hub
    answered with an error."""
    from huggingface_hub import HfApi, constants
    from huggingface_hub.errors import HfHubHTTPError

    if constants.HF_HUB_OFFLINE:
        return None, OFFLINE
    try:
        return query(HfApi()), ""
    except HfHubHTTPError as exc:
        raise HubRefusal(f"{constants.ENDPOINT}: {first_line(exc)}") from exc
    except Exception as exc:  # noqa: BLE001 - any transport failure: the local cache is what is left
        why = f"{constants.ENDPOINT} cannot be reached ({first_line(exc)})"
    work_offline(why)
    return None, why


def work_offline(why: str) -> None:
    """Every later hub access of this process (and of the processes it starts) uses the local cache
    (the caller says so once it found what it needs there, else fails in one line with ``why``)."""
    from huggingface_hub import constants

    constants.HF_HUB_OFFLINE = True
    os.environ["HF_HUB_OFFLINE"] = "1"
    datasets = sys.modules.get("datasets.config")  # it copied the setting when it was imported
    if datasets is not None:
        datasets.HF_HUB_OFFLINE = True
