"""The server the regenerate tests share: one ``transformers serve`` per test module (it starts in
seconds to tens of seconds), serving the embedded target's stopping variant
(:func:`tests.support.serving.stopping_target`), so greedy answers end both ways."""

from __future__ import annotations

import pytest

from tests.support.serving import Server, stopping_target


@pytest.fixture(scope="session")
def served_model(embedded, tmp_path_factory) -> str:
    return stopping_target(embedded.stock, str(tmp_path_factory.mktemp("served") / "target"))


@pytest.fixture(scope="module")
def server(served_model, tmp_path_factory):
    with Server(served_model, str(tmp_path_factory.mktemp("server") / "serve.log")) as live:
        yield live
