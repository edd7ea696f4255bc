"""One HTTP request to one endpoint, and what its failure means.

The standard library's ``http.client``, one keep-alive connection per (thread, endpoint): 16 requests
in flight are 16 threads blocked in ``recv``, which costs the client almost nothing next to the
seconds a server spends generating (BENCHMARKS.md measures the client's CPU per request).

A failure is sorted for the retry loop (``endpoints``):
* :class:`Unreachable`: nothing listens (connection refused, no route, DNS): the endpoint is down,
  not the row's fault; it leaves the rotation for a while. :class:`Misdirected` is one: the URL
  answers a redirect (3xx), so no chat completion is served there, whatever the row.
* :class:`Transient`: the server answered 429/5xx, the request timed out (``timeout`` is a deadline
  over the whole request: a server trickling its answer a byte at a time times out too), the
  connection broke mid-request, or the answer is not JSON (or nested too deep to read): worth
  retrying after a backoff.
* :class:`Rejected`: any other status (400: a prompt too long for the model, a bad parameter), or
  an answer larger than any chat completion (:data:`MAX_ANSWER_BYTES`): retrying sends the same
  request again, so the row fails at once with the server's words.
* :class:`Refused`: 401 or 403: the endpoint refuses the credentials. Every row would fail the same
  way, so the run stops instead.
"""

from __future__ import annotations

import heapq
import http.client
import itertools
import json
import os
import socket
import threading
import time
from typing import Any
from urllib.parse import urlsplit

CONNECT_TIMEOUT_S = 10.0
RETRY_STATUSES = frozenset({408, 409, 425, 429, 500, 502, 503, 504})
REFUSED_STATUSES = frozenset({401, 403})
BUSY_STATUS = 429  # a busy server, not a failing one: retried, but never a reason to leave the rotation
# A chat completion of 128k tokens is well under a megabyte of JSON: an answer past this is not one, and
# reading it whole (times --concurrency) could take the machine's memory.
MAX_ANSWER_BYTES = 32 << 20
_ERROR_TEXT = 300  # characters of a server's error body kept in a row's failure reason


class RequestFailed(Exception):
    """A request that got no usable answer; ``reason`` is short and says what happened, ``status`` is the
    HTTP status when the server answered one."""

    def __init__(self, reason: str, status: int | None = None) -> None:
        super().__init__(reason)
        self.reason = reason
        self.status = status


class Unreachable(RequestFailed):
    """No server answers at the endpoint."""


class Misdirected(Unreachable):
    """The endpoint answered a redirect: requests are not served at this URL (we never follow one: a
    redirect drops the body of a POST, and may lead a key elsewhere)."""


class Transient(RequestFailed):
    """Worth retrying: overloaded, a server error, a timeout or a broken connection."""


class Rejected(RequestFailed):
    """The server refused this request: sending it again gives the same answer."""


class Refused(RequestFailed):
    """The endpoint refuses our credentials (401/403): no request of this run can succeed there."""


def base_url(url: str) -> str:
    """``http://host:port`` from what a user passes (``.../v1``, a trailing slash); ValueError when not HTTP(S)."""
    parts = urlsplit(url.strip())
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(
            f"--endpoint {url!r} is not an http:// or https:// URL; pass e.g. http://127.0.0.1:8000"
        )
    path = parts.path.rstrip("/")
    path = path[: -len("/v1")] if path.endswith("/v1") else path
    return f"{parts.scheme}://{parts.netloc}{path}"


def _error_text(body: bytes) -> str:
    """The server's message from an error body (OpenAI's ``{"error": {"message": ...}}``, or the text)."""
    text = body.decode("utf-8", "replace")
    try:
        doc = json.loads(text)
        if isinstance(doc, dict):
            err = doc.get("error", doc.get("detail", doc))
            text = str(err.get("message", err) if isinstance(err, dict) else err)
    except (ValueError, RecursionError):  # not JSON, or nested too deep to read: the text as it is
        pass
    text = " ".join(text.split())
    return text if len(text) <= _ERROR_TEXT else text[:_ERROR_TEXT] + "..."


def _redirect(status: int, url: str, location: str | None) -> Misdirected:
    where = f" to {' '.join(location.split())[:200]}" if location else ""
    return Misdirected(f"HTTP {status} from {url}, a redirect{where}: no OpenAI-compatible server answers "
                       "at this URL; pass the URL the server itself answers at as --endpoint", status)


class _Deadline:
    """Shuts a connection's socket down when its request outlives ``timeout`` seconds in all: a read
    timeout alone restarts with every byte, so a server trickling its answer would hold it for ever."""

    def __init__(self, sock: socket.socket, timeout: float) -> None:
        self.at = time.monotonic() + timeout
        self._lock = threading.Lock()
        self._sock: socket.socket | None = sock
        self.expired = False
        _WATCHDOG.watch(self)

    def expire(self) -> None:
        with self._lock:
            if self._sock is None:  # the request ended first
                return
            self.expired = True
            try:
                self._sock.shutdown(socket.SHUT_RDWR)  # a blocked recv returns at once
            except OSError:
                pass

    def cancel(self) -> None:
        with self._lock:
            self._sock = None

    @property
    def pending(self) -> bool:
        return self._sock is not None


class _Watchdog:
    """One thread expiring every request's :class:`_Deadline` (a timer thread per request would cost
    more CPU than the rest of the request's client side)."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._heap: list[tuple[float, int, _Deadline]] = []
        self._order = itertools.count()
        self._pid = 0  # the process whose thread runs: a forked child starts its own
        self._compact_at = 1024

    def watch(self, deadline: _Deadline) -> None:
        with self._cond:
            heapq.heappush(self._heap, (deadline.at, next(self._order), deadline))
            if len(self._heap) >= self._compact_at:  # the requests that ended, dropped (amortised O(1))
                self._heap = [entry for entry in self._heap if entry[2].pending]
                heapq.heapify(self._heap)
                self._compact_at = max(1024, 2 * len(self._heap))
            if self._pid != os.getpid():
                self._pid = os.getpid()
                threading.Thread(target=self._run, name="regenerate-deadlines", daemon=True).start()
            elif self._heap[0][2] is deadline:
                self._cond.notify()

    def _run(self) -> None:
        with self._cond:
            while True:
                now = time.monotonic()
                while self._heap and self._heap[0][0] <= now:
                    heapq.heappop(self._heap)[2].expire()  # a cancelled one does nothing
                self._cond.wait(self._heap[0][0] - now if self._heap else None)


_WATCHDOG = _Watchdog()


class Client:
    """JSON over HTTP to one endpoint; thread-safe (each thread keeps its own connection)."""

    def __init__(self, url: str, api_key: str | None = None, timeout: float = 600.0) -> None:
        self.url = base_url(url)
        parts = urlsplit(self.url)
        self._https = parts.scheme == "https"
        self._host, self._port, self._prefix = parts.hostname, parts.port, parts.path
        self._headers = {"Content-Type": "application/json", "Accept": "application/json"}
        if api_key:
            self._headers["Authorization"] = f"Bearer {api_key}"
        self.timeout = timeout
        self._local = threading.local()

    def _connection(self, timeout: float) -> tuple[http.client.HTTPConnection, bool]:
        """This thread's connection, and whether it has carried a request before (a server may have closed it idle)."""
        conn = getattr(self._local, "conn", None)
        if conn is not None and conn.sock is not None:
            conn.timeout = timeout
            conn.sock.settimeout(timeout)
            return conn, True
        self.close()  # one with no socket (http.client closed it) would reconnect unwatched: a new one
        cls = http.client.HTTPSConnection if self._https else http.client.HTTPConnection
        conn = cls(self._host, self._port, timeout=min(CONNECT_TIMEOUT_S, timeout))
        try:  # connected here, with a short timeout: a host that drops packets is down, not slow
            conn.connect()
        except (OSError, http.client.HTTPException) as exc:
            conn.close()
            reason = "refused the connection" if isinstance(exc, ConnectionRefusedError) else \
                f"cannot be reached ({getattr(exc, 'strerror', None) or type(exc).__name__})"
            raise Unreachable(f"{self.url} {reason}") from None
        conn.sock.settimeout(timeout)
        self._local.conn = conn
        return conn, False

    def close(self) -> None:
        """Close this thread's connection (the next request opens a new one)."""
        conn = getattr(self._local, "conn", None)
        self._local.conn = None
        if conn is not None:
            conn.close()

    def request(self, method: str, path: str, payload: Any = None, timeout: float | None = None) -> Any:
        """The decoded JSON answer of ``method path``; raises a :class:`RequestFailed` subclass."""
        body = None if payload is None else json.dumps(payload).encode()
        timeout = self.timeout if timeout is None else timeout
        deadline = time.monotonic() + timeout
        for fresh_try in (False, True):
            conn, reused = self._connection(timeout)  # Unreachable when it cannot connect
            left = deadline - time.monotonic()
            watch = _Deadline(conn.sock, left)
            try:
                conn.sock.settimeout(max(left, 0.001))
                conn.request(method, self._prefix + path, body=body, headers=self._headers)
                resp = conn.getresponse()
                data = resp.read(MAX_ANSWER_BYTES + 1)
            except (OSError, http.client.HTTPException) as exc:
                self.close()
                if watch.expired or isinstance(exc, TimeoutError):
                    raise Transient(f"{self.url} did not answer within {timeout:g} s") from None
                if isinstance(exc, (http.client.RemoteDisconnected, BrokenPipeError, ConnectionResetError)):
                    if reused and not fresh_try:  # an idle keep-alive connection the server closed: again
                        continue
                    raise Transient(f"connection to {self.url} broke ({type(exc).__name__})") from None
                # connected, then broken: the request's fault or not
                raise Transient(f"connection to {self.url} failed ({type(exc).__name__}: {exc})") from None
            finally:
                watch.cancel()
            if watch.expired:  # an answer cut short by the shutdown reads as complete (http.client): not one
                self.close()
                raise Transient(f"{self.url} did not answer within {timeout:g} s")
            if len(data) > MAX_ANSWER_BYTES:
                # the rest of the body is never read: the connection cannot carry another request
                self.close()
                raise Rejected(
                    f"{self.url} answered more than {MAX_ANSWER_BYTES >> 20} MiB, which no chat completion is"
                )
            if resp.will_close:
                self.close()
            if 300 <= resp.status < 400:
                raise _redirect(resp.status, self.url, resp.getheader("Location"))
            if resp.status in RETRY_STATUSES:
                raise Transient(f"HTTP {resp.status} from {self.url}: {_error_text(data)}", resp.status)
            if resp.status in REFUSED_STATUSES:
                raise Refused(f"HTTP {resp.status} from {self.url}: {_error_text(data)}", resp.status)
            if resp.status != 200:
                raise Rejected(f"HTTP {resp.status} from {self.url}: {_error_text(data)}", resp.status)
            try:
                return json.loads(data)
            except ValueError:
                raise Transient(f"{self.url} answered {len(data)} bytes that are not JSON") from None
            except RecursionError:  # what no chat completion is, and reading it would exhaust the stack
                raise Transient(f"{self.url} answered JSON nested too deep to be a chat completion "
                                f"({len(data)} bytes)") from None
        raise AssertionError("unreachable")
