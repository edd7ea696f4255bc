"""Which assistant turns of a row are regenerated, and the row rebuilt around the new ones.

System, user and tool turns are kept as they are. ``--turns all``: every assistant turn, in
order, each asked with the history as regenerated so far (what the target would have said in that
conversation); ``--turns last``: only the last assistant turn, given the original history. A row
with no assistant turn at all (prompts only) gets one, answering its last turn. Turns after the
last assistant turn stay.

The history sent leaves out earlier turns' ``reasoning_content``: chat templates drop it from past
turns anyway, and not every server accepts the field in a request.
"""

from __future__ import annotations

from typing import Any, Callable

from dspark_cache.regenerate.endpoints import Reply

Generate = Callable[[list[dict[str, Any]]], Reply]


def targets(messages: list[dict[str, Any]], turns: str) -> list[int]:
    """Positions of the assistant turns to regenerate (``[len(messages)]``: append one)."""
    positions = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
    if not positions:
        return [len(messages)]
    return positions if turns == "all" else positions[-1:]


def _sent(message: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in message.items() if k != "reasoning_content"}


def regenerate(messages: list[dict[str, Any]], turns: str, generate: Generate) -> tuple[list[dict[str, Any]],
                                                                                         list[Reply]]:
    """The row's messages with its target turns replaced by ``generate``'s replies, and the replies."""
    wanted = set(targets(messages, turns))
    out: list[dict[str, Any]] = []
    replies: list[Reply] = []
    for i in range(len(messages) + 1):
        if i in wanted:
            reply = generate([_sent(m) for m in out])
            replies.append(reply)
            out.append(reply.message)
        elif i < len(messages):
            out.append(messages[i])
    return out, replies
