"""The endpoints in rotation, and one chat request carried through them with retries.

Requests go round-robin over the endpoints that are up. One that refuses connections or answers a
redirect (3xx: no chat completion is served at that URL, whatever the row), or fails
:data:`DOWN_AFTER` requests in a row while another is up (5xx, timeouts, broken connections: a server
that hangs or keeps erroring is as dead as one that is gone), is taken out of the rotation and tried
again after a delay that doubles while it stays down (up to :data:`MAX_DOWN_S`); a good answer puts
it back. A 429 is a busy server, not a dead one: the request backs off and the endpoint stays. When
every endpoint is down the requests wait for the first to come back, and after ``give_up_after``
seconds of none answering the run stops with :class:`NoEndpointError`, one line naming each endpoint
and why (rerun to resume). An endpoint that refuses our credentials stops the run
(:class:`EndpointError`), as one that serves another model does.
"""

from __future__ import annotations

import logging
import random
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from dspark_cache.regenerate.client import (
    BUSY_STATUS, Client, Misdirected, Refused, Rejected, RequestFailed, Transient, Unreachable,
)
from dspark_cache.regenerate.output import encode_line
from dspark_cache.regenerate.settings import API_KEY_ENV

log = logging.getLogger(__name__)

FIRST_DOWN_S = 1.0  # an endpoint that refused is tried again after this, then twice as long each time
MAX_DOWN_S = 30.0
DOWN_AFTER = 3  # failed requests in a row (not 429s) that take an answering endpoint out of the rotation
BACKOFF_S = 0.5  # the first retry's wait; doubled each retry, capped, with jitter
MAX_BACKOFF_S = 30.0
PROBE_TIMEOUT_S = 10.0


class NoEndpointError(Exception):
    """No endpoint answers (at the start, or for ``give_up_after`` seconds during the run)."""


class EndpointError(Exception):
    """An endpoint no request of this run can succeed on; the run stops (the message says what to fix)."""


class ModelMismatchError(EndpointError):
    """The endpoints serve another model than the run's (at the start, or a server restarted with another)."""


def same_model(answered: str, served: str) -> bool:
    """Whether a completion's ``model`` names the model ``/v1/models`` lists as ``served``. ``transformers
    serve`` answers for a hub id with the revision it resolved (``org/name@main``); hub ids never hold an ``@``."""
    return answered == served or answered.startswith(served + "@")


def _text(value: Any, what: str) -> str | None:
    """``value`` when it is text (or None) that JSON can carry as UTF-8; else ValueError naming ``what``."""
    if value is None:
        return None
    if not isinstance(value, str):
        raise ValueError(f"its {what} is {type(value).__name__}, not text")
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        raise ValueError(f"its {what} holds a lone UTF-16 surrogate, which is not text") from None
    return value


class RowFailed(Exception):
    """A row's request failed for good; ``reason`` goes into OUTPUT.failed, or OUTPUT.skipped when ``final``:
    the server refused this very request (a 4xx) or answered what no output line can hold, and would
    again (the same messages, sampling settings and seed)."""

    def __init__(self, reason: str, final: bool = False) -> None:
        super().__init__(reason)
        self.reason = reason
        self.final = final


@dataclass
class Reply:
    """One regenerated assistant turn as the server gave it."""

    message: dict[str, Any]
    finish_reason: str
    completion_tokens: int


def parse_reply(doc: Any, url: str) -> tuple[Reply, str]:
    """The reply and the model named in a chat completion: :class:`Transient` when it is not one (a
    gateway's page, a cut answer), :class:`Rejected` when its message cannot be written (what is written
    comes from here: text that ``dspark-produce`` reads, or nothing)."""
    try:
        choice = doc["choices"][0]
        msg = choice["message"]
        if not isinstance(msg, dict):
            raise ValueError("its message is not an object")
        message: dict[str, Any] = {"role": "assistant", "content": _text(msg.get("content"), "content") or ""}
        # vLLM names the thinking "reasoning_content" (newer releases also "reasoning"); SGLang and
        # transformers serve "reasoning_content". The producer reads reasoning_content.
        reasoning = _text(msg.get("reasoning_content"), "reasoning_content") or _text(
            msg.get("reasoning"), "reasoning"
        )
        if reasoning:
            message["reasoning_content"] = reasoning
        calls = msg.get("tool_calls")
        if calls:
            if not isinstance(calls, list) or not all(
                isinstance(c, dict) and isinstance(c.get("function"), dict) for c in calls
            ):
                raise ValueError("its tool_calls are not a list of function calls")
            message["tool_calls"] = calls
        try:
            encode_line(message)
        except (TypeError, ValueError, UnicodeEncodeError) as exc:
            raise ValueError(f"it holds what JSON text cannot ({type(exc).__name__}: {exc})") from None
        except RecursionError:
            raise ValueError("it is nested deeper than JSON text can be written here") from None
        usage = doc.get("usage") or {}
        tokens = usage.get("completion_tokens") or 0
        if not isinstance(tokens, int) or isinstance(tokens, bool) or tokens < 0:
            raise TypeError("completion_tokens is not a count")
        reply = Reply(message, _text(choice.get("finish_reason"), "finish_reason") or "stop", tokens)
        return reply, _text(doc.get("model"), "model") or ""
    except ValueError as exc:
        raise Rejected(f"{url} answered a chat completion whose message cannot be written: {exc}") from None
    except (KeyError, IndexError, TypeError, AttributeError):
        raise Transient(f"{url} answered JSON that is not a chat completion") from None


@dataclass
class _Endpoint:
    client: Client
    down_until: float = 0.0
    down_for: float = 0.0
    last_error: str = ""
    served: list[str] = field(default_factory=list)
    failures: int = 0  # failed requests in a row since its last good answer (429s not counted)

    @property
    def url(self) -> str:
        return self.client.url


class EndpointPool:
    """The endpoints, which are up, and :meth:`chat` (a request with retries); thread-safe."""

    def __init__(self, urls: list[str], api_key: str | None = None, timeout: float = 600.0, retries: int = 6,
                 give_up_after: float = 300.0) -> None:
        self._endpoints = [_Endpoint(Client(u, api_key, timeout)) for u in dict.fromkeys(urls)]
        self.retries = retries
        self.give_up_after = give_up_after
        self.model = ""
        self._lock = threading.Lock()
        self._turn = 0
        self._all_down_since: float | None = None
        self._stopping = threading.Event()

    @property
    def urls(self) -> list[str]:
        return [e.url for e in self._endpoints]

    def stop(self) -> None:
        """Wake every request waiting for an endpoint or a backoff: they raise :class:`NoEndpointError`."""
        self._stopping.set()

    @property
    def stopped(self) -> bool:
        return self._stopping.is_set()

    # -- the model ---------------------------------------------------------------------------

    def probe(self, wanted: str | None = None) -> str:
        """Ask every endpoint's ``/v1/models``; the model the run uses (``wanted`` or the one served).

        Endpoints that do not answer leave the rotation (tried again later); none answering is a
        :class:`NoEndpointError`, endpoints that disagree a :class:`ModelMismatchError`."""
        for ep in self._endpoints:
            try:
                doc = ep.client.request("GET", "/v1/models", timeout=PROBE_TIMEOUT_S)
                ep.served = [str(m["id"]) for m in doc["data"]]
            except Refused as exc:
                raise EndpointError(refused_message(exc)) from None
            except RequestFailed as exc:
                self._mark_down(ep, exc.reason)
            except (KeyError, TypeError):
                self._mark_down(ep, "its /v1/models is not an OpenAI model list")
        live = [ep for ep in self._endpoints if ep.served]
        if not live:
            raise NoEndpointError(self.why_none())
        for ep in self._endpoints:
            if not ep.served:
                log.warning("endpoint %s does not answer (%s); it is left out and tried again later", ep.url,
                            ep.last_error)
        model = wanted or live[0].served[0]
        for ep in live:
            if model not in ep.served:
                raise ModelMismatchError(
                    f"{ep.url} serves {', '.join(ep.served) or 'no model'}, not {model}: "
                    "point every --endpoint at servers of the same model"
                    + ("" if wanted else ", or choose one with --model")
                )
            if not wanted and len(ep.served) > 1:
                raise ModelMismatchError(
                    f"{ep.url} serves several models ({', '.join(ep.served)}); choose one with --model"
                )
        self.model = model
        return model

    def why_none(self) -> str:
        detail = "; ".join(f"{ep.url} ({ep.last_error or 'no answer'})" for ep in self._endpoints)
        return (
            f"no endpoint answers: {detail}. Start the server (vllm serve / transformers serve ...) or fix "
            "--endpoint, then rerun the same command"
        )

    # -- rotation ----------------------------------------------------------------------------

    def _mark_down(self, ep: _Endpoint, reason: str) -> None:
        with self._lock:
            self._down(ep, reason, time.monotonic())

    def _down(self, ep: _Endpoint, reason: str, now: float) -> None:
        """Take ``ep`` out of the rotation (the lock held)."""
        ep.down_for = min(MAX_DOWN_S, ep.down_for * 2 or FIRST_DOWN_S)
        ep.down_until = now + ep.down_for
        ep.last_error = reason
        if self._all_down_since is None and all(e.down_until > now for e in self._endpoints):
            self._all_down_since = now

    def _mark_up(self, ep: _Endpoint) -> None:
        with self._lock:
            if ep.down_for:
                log.info("endpoint %s answers again", ep.url)
            ep.down_for, ep.down_until, ep.failures = 0.0, 0.0, 0
            self._all_down_since = None

    def _failed(self, ep: _Endpoint, exc: Transient) -> None:
        """Count a failed request against ``ep``: the :data:`DOWN_AFTER`-th in a row takes it out of the rotation
        while another endpoint is up to take its requests (alone, it would only delay the retries' own backoff)."""
        if exc.status == BUSY_STATUS:
            return
        with self._lock:
            ep.failures += 1
            now = time.monotonic()
            others = any(e is not ep and e.down_until <= now for e in self._endpoints)
            if ep.failures < DOWN_AFTER or ep.down_until > now or not others:
                return
            log.warning(
                "endpoint %s failed %d requests in a row (last: %s); left out of the rotation for a while",
                ep.url,
                ep.failures,
                exc.reason,
            )
            self._down(ep, f"failed {ep.failures} requests in a row, the last: {exc.reason}", now)

    def _pick(self) -> _Endpoint:
        """The next endpoint that is up, waiting while none is; :class:`NoEndpointError` once given up."""
        while True:
            with self._lock:
                now = time.monotonic()
                up = [e for e in self._endpoints if e.down_until <= now]
                if up:
                    self._turn += 1
                    return up[self._turn % len(up)]
                if self._all_down_since is not None and now - self._all_down_since > self.give_up_after:
                    raise NoEndpointError(
                        self.why_none().replace(
                            "no endpoint answers", f"no endpoint answered for {self.give_up_after:g} s"
                        )
                    )
                wait = min(e.down_until for e in self._endpoints) - now
            if self._stopping.wait(min(max(wait, 0.01), 1.0)):
                raise NoEndpointError("stopped")

    # -- one request -------------------------------------------------------------------------

    def chat(self, body: dict[str, Any]) -> Reply:
        """``body`` (model added) sent to ``/v1/chat/completions``, retried on the endpoints in rotation."""
        body = {"model": self.model, **body}
        tries = 0
        while True:
            ep = self._pick()
            try:
                doc = ep.client.request("POST", "/v1/chat/completions", body)
                reply, model = parse_reply(doc, ep.url)
            except Unreachable as exc:  # the endpoint's fault (down, redirecting), not the row's: no retry
                log.warning("endpoint %s %s (%s); left out of the rotation for a while", ep.url,
                            "redirects" if isinstance(exc, Misdirected) else "is down", exc.reason)
                self._mark_down(ep, exc.reason)
                continue
            except Refused as exc:
                raise EndpointError(refused_message(exc)) from None
            except Rejected as exc:
                self._mark_up(ep)
                raise RowFailed(exc.reason, final=True) from None
            except Transient as exc:
                self._failed(ep, exc)
                tries += 1
                if tries > self.retries:
                    raise RowFailed(f"{exc.reason} (after {self.retries} retries)") from None
                delay = min(MAX_BACKOFF_S, BACKOFF_S * 2 ** (tries - 1)) * random.uniform(0.5, 1.0)
                log.info("%s; retry %d/%d in %.1f s", exc.reason, tries, self.retries, delay)
                if self._stopping.wait(delay):
                    raise NoEndpointError("stopped") from None
                continue
            self._mark_up(ep)
            if model and not same_model(model, self.model):
                raise ModelMismatchError(
                    f"{ep.url} now serves {model}, not {self.model} (the model this run records): "
                    "restart it with the original model, or write to another --output"
                )
            return reply


def refused_message(exc: RequestFailed) -> str:
    keys = " or ".join(f"${name}" for name in API_KEY_ENV)
    return (
        f"{exc.reason}: the endpoint refuses this client's credentials. Pass --api-key (or set {keys}) to the "
        "key the server was started with, then rerun the same command"
    )
