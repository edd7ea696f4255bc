"""The object-store client library, configured: obstore imported once it is needed (or the missing extra
named), the storage options split as it takes them, and its panics kept to one line.

``storage_options`` (``--storage-options JSON``) holds the client's configuration keys (``endpoint``,
``region``, ``access_key_id``, ...) plus ``client_options`` and ``retry_config``; their values are
never logged or put in a message. A client option given at the top level (``{"allow_http": true,
"timeout": "30s"}``, with or without the store's ``aws_`` prefix) is moved into ``client_options``, as
are ``max_retries`` and ``retry_timeout`` into ``retry_config`` (durations in seconds or as the
client's strings); an unknown key is refused by name.

A panic of the client library (a Rust ``panic!``, which Python sees as a ``BaseException`` and Rust
reports with its own lines on stderr) comes out as the same one-line error as any other failure.
"""

from __future__ import annotations

import contextlib
import os
import re
import sys
import tempfile
import threading
from datetime import timedelta
from typing import Any, Iterator

from dspark_cache.format.errors import CacheError
from dspark_cache.storage.remote.url import RemoteURL

EXTRA = "dspark-cache[s3]"
_STDERR_HELD = threading.Lock()  # _panics_quiet's hold on file descriptor 2
# The HTTP client's options (obstore's ClientConfig): given at the top level of the storage options, the
# client would take them for the store's own keys and panic; they are moved into client_options.
CLIENT_KEYS = frozenset((
    "allow_http", "allow_invalid_certificates", "connect_timeout", "default_content_type", "default_headers",
    "http1_only", "http2_keep_alive_interval", "http2_keep_alive_timeout", "http2_keep_alive_while_idle",
    "http2_only", "pool_idle_timeout", "pool_max_idle_per_host", "proxy_url", "proxy_ca_certificate",
    "proxy_excludes", "root_certificate", "randomize_addresses", "read_timeout", "timeout", "user_agent"))
RETRY_KEYS = frozenset(("max_retries", "retry_timeout", "backoff"))
_DURATIONS = ("retry_timeout", "init_backoff", "max_backoff")  # timedeltas for the client; seconds in JSON
_STORE_PREFIXES = ("aws_", "google_", "azure_")


class MissingExtraError(CacheError):
    """The object-store client is not installed."""


def _client() -> Any:
    try:
        import obstore
        import obstore.store  # noqa: F401  (the submodule from_url lives in)
    except ImportError as exc:
        raise MissingExtraError(
            f'caches on object storage need the optional client: pip install "{EXTRA}" (obstore), then rerun'
        ) from exc
    return obstore


def _default_client_options(endpoint: str | None) -> dict[str, Any]:
    options: dict[str, Any] = {"timeout": "300s", "connect_timeout": "10s"}
    if endpoint and endpoint.startswith("http://"):
        options["allow_http"] = True  # a local MinIO or test server: the user pointed us there
    return options


def _default_retry() -> dict[str, Any]:
    return {
        "max_retries": 8,
        "retry_timeout": timedelta(minutes=3),
        "backoff": {
            "init_backoff": timedelta(milliseconds=100),
            "max_backoff": timedelta(seconds=15),
            "base": 2,
        },
    }


def client_endpoint(config: dict[str, Any]) -> str | None:
    """The endpoint the client talks to: the options' spelling of it, else the AWS_ENDPOINT_URL variables."""
    for key in ("aws_endpoint_url_s3", "endpoint_url", "endpoint", "aws_endpoint", "aws_endpoint_url"):
        if config.get(key):
            return str(config[key])
    return (
        os.environ.get("AWS_ENDPOINT_URL_S3")
        or os.environ.get("AWS_ENDPOINT_URL")
        or os.environ.get("AWS_ENDPOINT")
    )


def first_line(exc: BaseException) -> str:
    text = " ".join(str(exc).split("Debug source:")[0].split())  # obstore appends a multi-line Debug dump
    return text[:300] + ("..." if len(text) > 300 else "")


def is_panic(exc: BaseException) -> bool:
    """A panic of the client library (pyo3's ``PanicException``, a ``BaseException`` no module exports)."""
    return type(exc).__name__ == "PanicException"


@contextlib.contextmanager
def _panics_quiet() -> Iterator[None]:
    """While the client is configured, file descriptor 2 goes to a temporary file: a panic's own report
    (the message, and a backtrace where RUST_BACKTRACE is set), which Rust writes there itself, is
    dropped, as the error raised for it says the same in one line; anything else written is passed on."""
    sys.stderr.flush()
    with _STDERR_HELD, tempfile.TemporaryFile() as held:  # one at a time: fd 2 is the process's
        saved = os.dup(2)
        panicked = False
        os.dup2(held.fileno(), 2)
        try:
            yield
        except BaseException as exc:
            panicked = is_panic(exc)
            raise
        finally:
            os.dup2(saved, 2)
            os.close(saved)
            if not panicked:
                held.seek(0)
                written = held.read()
                if written:
                    os.write(2, written)


def _client_settings(config: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any], dict[str, Any] | None]:
    """The storage options split as the client takes them: the store's keys, the HTTP client's options and
    the retry configuration (``None``: the default); client and retry keys given at the top level are
    moved where they belong (``ValueError`` where one is also given there)."""
    config = dict(config)
    client = dict(config.pop("client_options", None) or {})
    given_retry = config.pop("retry_config", None)
    retry = dict(given_retry) if given_retry else None
    top_retry: dict[str, Any] = {}
    for key in list(config):
        bare = key.lower()
        bare = next((bare[len(p):] for p in _STORE_PREFIXES if bare.startswith(p)), bare)
        section, into = ("client_options", client) if bare in CLIENT_KEYS else (
            ("retry_config", top_retry) if bare in RETRY_KEYS else (None, None))
        if into is None:
            continue
        if bare in into or (section == "retry_config" and retry is not None and bare in retry):
            raise ValueError(f"{key} is given both at the top level and in {section}; keep one")
        into[bare] = config.pop(key)
    if top_retry:
        retry = {**(retry or _default_retry()), **top_retry}
    if retry is not None:
        retry = {k: _duration(k, v) for k, v in retry.items()}
        if isinstance(retry.get("backoff"), dict):
            retry["backoff"] = {k: _duration(k, v) for k, v in retry["backoff"].items()}
    if "endpoint_url" in config:  # the spelling boto3 and s3fs users know
        config["endpoint"] = config.pop("endpoint_url")
    return config, client, retry


def _duration(name: str, value: Any) -> Any:
    """A retry duration given in seconds (JSON has no timedelta) as the client's timedelta."""
    if name in _DURATIONS and isinstance(value, (int, float)) and not isinstance(value, bool):
        return timedelta(seconds=value)
    return value


def configure(url: RemoteURL, storage_options: dict[str, Any] | None) -> tuple[Any, Any]:
    """``(obstore, the client for url's store)`` from the storage options; ``ValueError`` saying what is
    wrong with them (a key, never a value: they may hold secrets)."""
    obstore = _client()
    try:
        config, client, retry = _client_settings(storage_options or {})
    except ValueError as exc:
        raise ValueError(f"the storage options: {exc}") from None
    client_options = {**_default_client_options(client_endpoint(config)), **client}
    try:
        with _panics_quiet():
            return obstore, obstore.store.from_url(url.store_url, config=config or None,
                                                   client_options=client_options,
                                                   retry_config=retry or _default_retry())
    except (KeyboardInterrupt, SystemExit):
        raise
    except BaseException as exc:  # an unknown key, a malformed value, a panic: never echo the values
        unknown = re.search(r"(?:Configuration key: '|Invalid key: )([^'.\s]+)", str(exc))
        if unknown:
            raise ValueError(f"the storage option {unknown[1]!r} is not one the object-store client knows "
                             f"for {url.scheme}://") from None
        what = "failed on" if is_panic(exc) else "refused"
        raise ValueError(f"the object-store client {what} its configuration ({type(exc).__name__}: "
                         f"{first_line(exc)})") from None
