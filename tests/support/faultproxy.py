"""A fault-injecting HTTP/1.1 proxy: it stands between a client and a real server (the S3 server of
:mod:`tests.support.s3server` for the object-store tests, ``transformers serve`` for
``dspark-regenerate``'s) and, on the requests a test picks, misbehaves the ways a real server and
network do, so retries, timeouts and error mapping are tested for real.

Plain pass-through is a real HTTP/1.1 relay (keep-alive, ``Content-Length`` and chunked bodies,
``Expect: 100-continue``), not a byte pump, because faults are counted *per request*: a pooled
client sends many requests on one connection, and the proxy must see each request line to decide.
Bodies are streamed, never held whole (64 MiB PUTs and GETs and multipart uploads pass). The
client's connection is kept alive as long as the client wants, whatever the upstream does (moto's
werkzeug closes after every response; the proxy then reconnects upstream for the next request),
so a fault can hit a pooled, reused connection as with a real store: ``Request.index``.

Fault kinds (:data:`KINDS`), each hitting one request:
  ``reset``  read the request head, then abort the client connection (``SO_LINGER`` 0: a TCP RST)
             without answering.
  ``stall``  read the request head, then neither read nor answer for ``stall_s`` seconds (the
             request body is left unread: an uploading client blocks too), then close; it ends
             sooner when the client hangs up first (its timeout fired) or on ``stop()``.
  ``503``    drain the request body and answer ``503 Slow Down`` with S3's ``SlowDown`` XML error,
             ``Connection: close``.
  ``500``    the same with ``500 Internal Server Error`` and ``InternalError``.
  ``429``    the same with ``429 Too Many Requests`` (an inference server's rate limit).
The error bodies are S3's XML (``dialect="s3"``, the default) or an OpenAI-style JSON error
(``dialect="openai"``), as the server behind the proxy would send them.
  ``cut``    forward the request, relay the response head and ``cut_after`` bytes of its body,
             then RST: a download that dies midway.
  ``answer`` drain the request body and answer ``status`` with ``body`` (JSON; or ``raw`` bytes as
             they are) and any extra ``headers``, never asking the server: a server that answers
             what no real one should (a reply that is not a chat message, a refused key, a
             redirect, JSON nested a hundred thousand deep).
  ``trickle`` drain the request body, answer ``200 OK`` with a long ``Content-Length`` and send its
             body one space every ``trickle_s`` seconds until the client hangs up (or ``stop()``):
             a server that never stops answering, so a client's read timeout never fires.
  ``hold``   read the request head, then wait until :meth:`FaultProxy.release` (or ``stop()``), and
             only then forward it whole and relay the answer: a request that lands late, after what
             the test did meanwhile (a late commit of a producer that lost its lease).
  ``drop``   forward the request and let the server act on it, then abort the client connection
             instead of relaying the answer (``SO_LINGER`` 0): an answer lost after the write landed.
  ``drop500`` the same, answering ``500 Internal Server Error`` instead: the client retries a
             request that already took effect.

Stdlib only; one thread per client connection. ``stop()`` unblocks and ends every thread.
"""

from __future__ import annotations

import itertools
import json
import logging
import select
import socket
import struct
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

log = logging.getLogger(__name__)

KINDS = ("reset", "stall", "503", "500", "429", "cut", "answer", "trickle", "hold", "drop", "drop500")
_FORWARDED = ("cut", "hold", "drop", "drop500")  # kinds that send the request on to the server
DIALECTS = ("s3", "openai")
DEFAULT_STALL_S = 3600.0
_CHUNK = 1 << 20
_MAX_HEAD = 64 * 1024
_ERRORS = {
    "503": ("503 Slow Down", "SlowDown", "Please reduce your request rate."),
    "500": ("500 Internal Server Error", "InternalError",
            "We encountered an internal error. Please try again."),
    "429": ("429 Too Many Requests", "SlowDown", "Please reduce your request rate."),
}


@dataclass(frozen=True)
class Request:
    """One HTTP request as the proxy saw it (what a fault predicate decides on)."""

    method: str
    target: str  # as sent: path and query, e.g. "/bucket/a/b.tar?partNumber=1&uploadId=..."
    headers: dict[str, str]  # names lower-cased
    connection: int  # serial number of the client connection (from 0)
    index: int  # its place on that connection: 0 = the first request of a new connection

    @property
    def path(self) -> str:
        return self.target.split("?", 1)[0]

    @property
    def query(self) -> str:
        return self.target.split("?", 1)[1] if "?" in self.target else ""


Match = Callable[[Request], bool]


def matching(method: str | None = None, suffix: str | None = None, contains: str | None = None,
             query: str | None = None, new_connection: bool | None = None) -> Match:
    """A predicate for :meth:`FaultProxy.fail_next`: every given condition must hold (``suffix`` and
    ``contains`` test the path without the query, ``query`` is a substring of the query)."""

    def match(req: Request) -> bool:
        return ((method is None or req.method == method.upper())
                and (suffix is None or req.path.endswith(suffix))
                and (contains is None or contains in req.path)
                and (query is None or query in req.query)
                and (new_connection is None or (req.index == 0) == new_connection))

    return match


@dataclass
class _Plan:
    kind: str
    remaining: int | None  # None: every matching request until clear()
    match: Match | None
    stall_s: float
    cut_after: int
    answer: tuple[str, bytes] = ("200 OK", b"")  # ``answer``: status line's status and body
    headers: tuple[tuple[str, str], ...] = ()  # ``answer``: more response headers
    trickle_s: float = 0.2


@dataclass(frozen=True)
class Seen:
    """A line of :attr:`FaultProxy.log`."""

    method: str
    target: str
    fault: str | None  # the kind injected, None when passed through


class _Broken(Exception):
    """The peer closed or sent something that is not HTTP/1.1: drop the connection."""


class _Cut(Exception):
    """The ``cut`` budget is spent: abort the client connection now."""


class _Reader:
    """Buffered reads from a socket: heads and lines from the buffer, bodies relayed in chunks."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.buf = bytearray()

    def _fill(self) -> bool:
        data = self.sock.recv(_CHUNK)
        self.buf += data
        return bool(data)

    def read_until(self, sep: bytes, limit: int = _MAX_HEAD) -> bytes | None:
        """Up to and including ``sep``; None on a clean EOF before any byte."""
        start = 0
        while True:
            pos = self.buf.find(sep, start)
            if pos >= 0:
                out = bytes(self.buf[: pos + len(sep)])
                del self.buf[: pos + len(sep)]
                return out
            if len(self.buf) > limit:
                raise _Broken(f"no {sep!r} within {limit} bytes")
            start = max(0, len(self.buf) - len(sep) + 1)
            if not self._fill():
                if not self.buf:
                    return None
                raise _Broken("EOF inside a head")

    def relay(self, dst: _Sink, n: int) -> None:
        """Exactly ``n`` bytes to ``dst``."""
        if self.buf:
            take = min(n, len(self.buf))
            dst.send(memoryview(self.buf)[:take])
            del self.buf[:take]
            n -= take
        chunk = bytearray(min(_CHUNK, max(n, 1)))
        view = memoryview(chunk)
        while n > 0:
            got = self.sock.recv_into(view[: min(n, len(chunk))])
            if not got:
                raise _Broken("EOF inside a body")
            dst.send(view[:got])
            n -= got

    def relay_chunked(self, dst: _Sink) -> None:
        """A ``Transfer-Encoding: chunked`` body, framing and trailers included."""
        while True:
            line = self.read_until(b"\r\n", 4096)
            if line is None:
                raise _Broken("EOF inside a chunked body")
            dst.send(line)
            size = int(line.split(b";", 1)[0].strip(), 16)
            if size == 0:
                while True:  # trailers, up to the empty line
                    trailer = self.read_until(b"\r\n", _MAX_HEAD)
                    if trailer is None:
                        raise _Broken("EOF inside trailers")
                    dst.send(trailer)
                    if trailer == b"\r\n":
                        return
            self.relay(dst, size + 2)

    def relay_to_eof(self, dst: _Sink) -> None:
        if self.buf:
            dst.send(memoryview(self.buf))
            self.buf.clear()
        while data := self.sock.recv(_CHUNK):
            dst.send(data)


class _Sink:
    """Where relayed bytes go; ``budget`` bytes of body and then :class:`_Cut` (the ``cut`` kind)."""

    def __init__(self, sock: socket.socket | None, budget: int | None = None) -> None:
        self.sock = sock  # None: discard (draining a request we answer ourselves)
        self.budget = budget

    def send(self, data) -> None:
        if self.budget is not None and len(data) >= self.budget:
            if self.sock is not None and self.budget:
                self.sock.sendall(data[: self.budget])
            raise _Cut()
        if self.budget is not None:
            self.budget -= len(data)
        if self.sock is not None:
            self.sock.sendall(data)


@dataclass
class _Head:
    raw: bytes
    first: list[str]  # request line or status line, split in three
    headers: dict[str, str] = field(default_factory=dict)

    @classmethod
    def parse(cls, raw: bytes) -> _Head:
        lines = raw.decode("latin-1").split("\r\n")
        first = lines[0].split(" ", 2)
        if len(first) < 2:
            raise _Broken(f"bad first line {lines[0]!r}")
        headers: dict[str, str] = {}
        for line in lines[1:]:
            if not line:
                continue
            name, sep, value = line.partition(":")
            if not sep:
                raise _Broken(f"bad header line {line!r}")
            name = name.strip().lower()
            headers[name] = f"{headers[name]}, {value.strip()}" if name in headers else value.strip()
        return cls(raw, first, headers)

    def wants_close(self, version: str) -> bool:
        tokens = {t.strip().lower() for t in self.headers.get("connection", "").split(",")}
        return "close" in tokens or (version == "HTTP/1.0" and "keep-alive" not in tokens)

    def without_connection(self) -> bytes:
        """The raw head with its ``Connection`` (and ``Keep-Alive``) headers dropped."""
        lines = self.raw.split(b"\r\n")
        drop = (b"connection", b"keep-alive")
        kept = [line for line in lines[1:] if line.split(b":", 1)[0].strip().lower() not in drop]
        return b"\r\n".join([lines[0], *kept])

    def relay_body(self, reader: _Reader, dst: _Sink) -> None:
        """Relay the request body this head announces (a request with neither header has none)."""
        if "chunked" in self.headers.get("transfer-encoding", "").lower():
            reader.relay_chunked(dst)
        elif "content-length" in self.headers:
            reader.relay(dst, int(self.headers["content-length"]))


class FaultProxy:
    """A proxy on ``127.0.0.1`` and a free port in front of ``upstream_host:upstream_port``."""

    def __init__(self, upstream_host: str, upstream_port: int, *, host: str = "127.0.0.1", port: int = 0,
                 stall_s: float = DEFAULT_STALL_S, dialect: str = "s3") -> None:
        if dialect not in DIALECTS:
            raise ValueError(f"dialect must be one of {DIALECTS}, not {dialect!r}")
        self.dialect = dialect
        self.upstream = (upstream_host, upstream_port)
        self.host = host
        self._want_port = port
        self.port: int | None = None
        self.stall_s = stall_s
        self._lock = threading.Lock()
        self._plans: list[_Plan] = []
        self._requests = 0
        self._connections = 0
        self._serials = itertools.count()
        self._faults: Counter[str] = Counter()
        self._log: list[Seen] = []
        self._stopping = threading.Event()
        self._released = threading.Event()  # ``hold``: set by release()
        self._listener: socket.socket | None = None
        self._acceptor: threading.Thread | None = None
        self._open: set[socket.socket] = set()
        self._threads: set[threading.Thread] = set()

    # -- lifecycle ---------------------------------------------------------------------------

    @property
    def endpoint(self) -> str:
        if self.port is None:
            raise RuntimeError("FaultProxy not started")
        return f"http://{self.host}:{self.port}"

    def start(self) -> FaultProxy:
        if self._listener is not None:
            return self
        self._stopping.clear()
        listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind((self.host, self._want_port))
        listener.listen(128)
        listener.settimeout(0.1)  # accept() polls the stop flag
        self._listener = listener
        self.port = listener.getsockname()[1]
        self._acceptor = threading.Thread(
            target=self._accept_loop, name=f"faultproxy-{self.port}", daemon=True
        )
        self._acceptor.start()
        log.info("fault proxy %s -> %s:%d", self.endpoint, *self.upstream)
        return self

    def stop(self) -> None:
        """Close the listener and every open connection (stalls end at once, held requests are
        dropped); idempotent."""
        self._stopping.set()
        if self._acceptor is not None:
            self._acceptor.join(5)
            self._acceptor = None
        if self._listener is not None:
            self._listener.close()
            self._listener = None
        with self._lock:
            sockets, threads = list(self._open), list(self._threads)
        for sock in sockets:
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        for thread in threads:
            thread.join(5)

    def __enter__(self) -> FaultProxy:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # -- the fault plan ----------------------------------------------------------------------

    def fail_next(self, n: int | None = 1, kind: str = "503", *, match: Match | None = None,
                  stall_s: float | None = None, cut_after: int = 0, status: str = "200 OK",
                  body: object = None, raw: bytes | None = None, headers: dict[str, str] | None = None,
                  trickle_s: float = 0.2, first: bool = False) -> None:
        """Fault the next ``n`` requests that ``match`` accepts (all requests when None) with
        ``kind``; ``n=None``: every such request until :meth:`clear`. Plans queue up: a request
        takes the first pending plan that matches it. ``cut_after``: body bytes a ``cut`` lets
        through; ``status``, ``body`` (sent as JSON) or ``raw`` (sent as given) and ``headers``:
        what an ``answer`` says; ``trickle_s``: the gap between a ``trickle``'s bytes. ``first``: ahead
        of the plans pending (a fault before a canned answer that has no limit)."""
        if kind not in KINDS:
            raise ValueError(f"kind must be one of {KINDS}, not {kind!r}")
        if n is not None and n < 1:
            raise ValueError("n must be >= 1 or None")
        payload = raw if raw is not None else json.dumps(body).encode()
        with self._lock:
            self._plans.insert(0 if first else len(self._plans), _Plan(
                kind, n, match, self.stall_s if stall_s is None else stall_s, cut_after, (status, payload),
                tuple((headers or {}).items()), trickle_s))

    def release(self) -> None:
        """Let every ``hold`` request go on to the server, those held now and any held later."""
        self._released.set()

    def clear(self) -> None:
        """Drop every pending fault (stalls in progress go on until ``stall_s`` or :meth:`stop`)."""
        with self._lock:
            self._plans.clear()

    @property
    def pending(self) -> int | None:
        """Faults still planned (None when a plan has no limit)."""
        with self._lock:
            if any(p.remaining is None for p in self._plans):
                return None
            return sum(p.remaining for p in self._plans)

    # -- counters ----------------------------------------------------------------------------

    @property
    def requests(self) -> int:
        """Requests seen (faulted ones included)."""
        with self._lock:
            return self._requests

    @property
    def connections(self) -> int:
        """Client connections accepted."""
        with self._lock:
            return self._connections

    @property
    def faults(self) -> dict[str, int]:
        """Faults injected, per kind (kinds never injected are 0)."""
        with self._lock:
            return {kind: self._faults[kind] for kind in KINDS}

    @property
    def log(self) -> list[Seen]:
        """Every request seen, in order, and the fault it got."""
        with self._lock:
            return list(self._log)

    def reset_counters(self) -> None:
        """Zero :attr:`requests`, :attr:`connections`, :attr:`faults` and :attr:`log` (the plan stays)."""
        with self._lock:
            self._requests = self._connections = 0
            self._faults.clear()
            self._log.clear()

    def _take(self, req: Request) -> _Plan | None:
        with self._lock:
            self._requests += 1
            chosen = None
            for plan in self._plans:
                if plan.match is None or plan.match(req):
                    chosen = plan
                    if plan.remaining is not None:
                        plan.remaining -= 1
                        if plan.remaining == 0:
                            self._plans.remove(plan)
                    self._faults[plan.kind] += 1
                    break
            self._log.append(Seen(req.method, req.target, chosen.kind if chosen else None))
            return chosen

    # -- serving -----------------------------------------------------------------------------

    def _accept_loop(self) -> None:
        while not self._stopping.is_set():
            try:
                client, _ = self._listener.accept()
            except socket.timeout:
                continue
            except OSError:
                return
            client.settimeout(None)
            client.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            with self._lock:
                serial = next(self._serials)
                self._connections += 1
                self._open.add(client)
            thread = threading.Thread(target=self._serve, args=(client, serial), daemon=True,
                                      name=f"faultproxy-{self.port}-c{serial}")
            with self._lock:
                self._threads.add(thread)
            thread.start()

    def _track(self, sock: socket.socket) -> None:
        with self._lock:
            self._open.add(sock)
        if self._stopping.is_set():  # stop() may have missed it
            sock.shutdown(socket.SHUT_RDWR)

    def _serve(self, client: socket.socket, serial: int) -> None:
        upstream: socket.socket | None = None
        up_reader: _Reader | None = None
        reader = _Reader(client)
        try:
            for index in range(1 << 62):
                raw = reader.read_until(b"\r\n\r\n")
                if raw is None or self._stopping.is_set():
                    return
                head = _Head.parse(raw)
                method, target = head.first[0], head.first[1]
                version = head.first[2] if len(head.first) > 2 else "HTTP/1.0"
                req = Request(method, target, head.headers, serial, index)
                plan = self._take(req)
                if plan is not None and plan.kind == "hold":
                    log.info("fault hold on %s %s until release()", method, target)
                    while not self._released.wait(0.1):
                        if self._stopping.is_set():
                            return
                if plan is not None and plan.kind not in _FORWARDED:
                    log.info(
                        "fault %s on %s %s (connection %d, request %d)",
                        plan.kind,
                        method,
                        target,
                        serial,
                        index,
                    )
                    self._inject(plan, client, reader, head)
                    return
                if upstream is None:
                    upstream = socket.create_connection(self.upstream)
                    upstream.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                    self._track(upstream)
                    up_reader = _Reader(upstream)
                cut = plan if plan is not None and plan.kind == "cut" else None
                lost = plan is not None and plan.kind in ("drop", "drop500")
                client_keep, upstream_keep = self._forward(head, version, reader, client, upstream, up_reader,
                                                           cut, deliver=not lost)
                if lost:
                    log.info("fault %s: the answer to %s %s is lost", plan.kind, method, target)
                    if plan.kind == "drop":
                        _abort(client)
                    else:
                        self._inject(_Plan("500", 1, None, 0.0, 0), client, reader, head, drain=False)
                    return
                if not upstream_keep:  # moto closes after every response: reconnect next time
                    with self._lock:
                        self._open.discard(upstream)
                    upstream.close()
                    upstream = up_reader = None
                if not client_keep:
                    return
        except _Cut:
            log.info("fault cut: connection %d aborted mid-response", serial)
            _abort(client)
        except (_Broken, OSError, ValueError) as exc:
            log.debug("connection %d dropped: %s", serial, exc)
        finally:
            for sock in (client, upstream):
                if sock is not None:
                    with self._lock:
                        self._open.discard(sock)
                    sock.close()
            with self._lock:
                self._threads.discard(threading.current_thread())

    def _forward(self, head: _Head, version: str, reader: _Reader, client: socket.socket,
                 upstream: socket.socket, up_reader: _Reader, plan: _Plan | None,
                 deliver: bool = True) -> tuple[bool, bool]:
        """One request to the upstream and its response back (``deliver`` false: read and dropped);
        whether the client's and the upstream's connections live on."""
        upstream.sendall(head.raw)
        to_upstream = _Sink(upstream)
        body_sent = True
        if head.headers.get("expect", "").lower() == "100-continue":
            status, resp = self._response_head(up_reader)
            if status == 100:
                client.sendall(resp.raw)
                head.relay_body(reader, to_upstream)
                status, resp = self._response_head(up_reader)
            else:
                body_sent = False  # the server answered first: the client sends no body
        else:
            head.relay_body(reader, to_upstream)
            status, resp = self._response_head(up_reader)
        while 100 <= status < 200:  # other interim responses pass through
            client.sendall(resp.raw)
            status, resp = self._response_head(up_reader)
        framing = _framing(head.first[0], status, resp.headers)
        upstream_keep = framing != "eof" and body_sent and not resp.wants_close(resp.first[0])
        client_keep = framing != "eof" and body_sent and not head.wants_close(version)
        # The client's connection lives on as long as the client wants it, whatever the upstream
        # does (werkzeug closes after each response): pooled connections, as with a real store.
        if deliver:
            client.sendall(resp.without_connection() if client_keep else resp.raw)
        to_client = _Sink(client if deliver else None, plan.cut_after if plan is not None else None)
        if framing == "chunked":
            up_reader.relay_chunked(to_client)
        elif framing == "length":
            up_reader.relay(to_client, int(resp.headers["content-length"]))
        elif framing == "eof":
            up_reader.relay_to_eof(to_client)
        if plan is not None:  # a cut whose budget outlasted the body: cut at its end
            raise _Cut()
        return client_keep, upstream_keep

    @staticmethod
    def _response_head(up_reader: _Reader) -> tuple[int, _Head]:
        raw = up_reader.read_until(b"\r\n\r\n")
        if raw is None:
            raise _Broken("upstream closed before answering")
        resp = _Head.parse(raw)
        return int(resp.first[1]), resp

    def _stall(self, client: socket.socket, seconds: float) -> None:
        """Answer nothing for ``seconds``, or until stop(), or until the client hangs up (its
        timeout fired: the thread need not linger); a body being sent is left unread."""
        deadline = time.monotonic() + seconds
        while not self._stopping.is_set():
            left = deadline - time.monotonic()
            if left <= 0:
                return
            readable, _, _ = select.select([client], [], [], min(left, 0.1))
            if readable:
                try:
                    if not client.recv(1, socket.MSG_PEEK):
                        return  # the client closed
                except OSError:
                    return
                self._stopping.wait(max(0.0, deadline - time.monotonic()))  # bytes waiting: just sit
                return

    def _inject(self, plan: _Plan, client: socket.socket, reader: _Reader, head: _Head,
                drain: bool = True) -> None:
        if plan.kind == "reset":
            _abort(client)
        elif plan.kind == "stall":
            self._stall(client, plan.stall_s)
        elif plan.kind == "trickle":
            head.relay_body(reader, _Sink(None))
            client.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n"
                           b"Content-Length: 1048576\r\n\r\n")
            while not self._stopping.wait(plan.trickle_s):
                client.sendall(b" ")  # OSError once the client hangs up: the thread ends
        else:
            if drain and head.headers.get("expect", "").lower() != "100-continue":
                head.relay_body(reader, _Sink(None))  # read it all, so closing sends no RST
            status, content_type, body = self._answer(plan)
            extra = "".join(f"{name}: {value}\r\n" for name, value in plan.headers)
            client.sendall((f"HTTP/1.1 {status}\r\nContent-Type: {content_type}\r\n{extra}"
                            f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n").encode() + body)
            try:
                client.shutdown(socket.SHUT_WR)
            except OSError:
                pass

    def _answer(self, plan: _Plan) -> tuple[str, str, bytes]:
        """The status, content type and body an ``answer`` or an error kind sends."""
        if plan.kind == "answer":
            return plan.answer[0], "application/json", plan.answer[1]
        status, code, message = _ERRORS[plan.kind]
        if self.dialect == "openai":
            return status, "application/json", json.dumps(
                {"error": {"message": message, "type": code, "code": int(plan.kind)}}).encode()
        return (
            status,
            "application/xml",
            (
                f'<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>{code}</Code>'
                f"<Message>{message}</Message><RequestId>faultproxy</RequestId></Error>"
            ).encode(),
        )


def _framing(method: str, status: int, headers: dict[str, str]) -> str:
    """How a response body ends: ``none``, ``chunked``, ``length`` or ``eof`` (connection close)."""
    if method == "HEAD" or status in (204, 304):
        return "none"
    if "chunked" in headers.get("transfer-encoding", "").lower():
        return "chunked"
    return "length" if "content-length" in headers else "eof"


def _abort(sock: socket.socket) -> None:
    """Close with a TCP RST rather than a FIN (``SO_LINGER`` on, timeout 0)."""
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    except OSError:
        pass
