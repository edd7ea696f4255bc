"""The server the regenerate tests share: one ``transformers serve`` per test module (it starts in
seconds to tens of seconds), serving the embedded target's stopping variant
(:func:`tests.support.serving.stopping_target`), so greedy answers end both ways. It serves it by a
hub id from a local Hugging Face cache, as a user serves ``Qwen/Qwen3-8B``: ``transformers serve`` then
lists the id as given and answers with the revision it resolved (``dspark-test/tiny@main``)."""

from __future__ import annotations

import pytest

from tests.support.hub import fake_hub
from tests.support.serving import Server, stopping_target

SERVED_ID = "dspark-test/tiny"


@pytest.fixture(scope="session")
def hub_cache(embedded, tmp_path_factory) -> str:
    """An ``HF_HUB_CACHE`` holding the stopping target as :data:`SERVED_ID`."""
    root = tmp_path_factory.mktemp("served")
    hub = str(root / "hub")
    fake_hub(stopping_target(embedded.stock, str(root / "target")), hub, SERVED_ID)
    return hub


@pytest.fixture(scope="module")
def server(hub_cache, tmp_path_factory):
    with Server(SERVED_ID, str(tmp_path_factory.mktemp("server") / "serve.log"),
                env={"HF_HUB_CACHE": hub_cache}) as live:
        yield live
