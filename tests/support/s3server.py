"""A real S3-compatible server for the tests and benches: moto's standalone server in a process of
its own.

A subprocess rather than moto's in-process decorators: the clients under test (obstore's Rust
client, s3fs, our producers in their own processes) speak real HTTP to it, so signing, retries,
timeouts and connection handling are exercised as against a real store, and the server's Python
work does not share the test's GIL. Moto accepts any credentials unless started with ``check_credentials=True``
(then a signature must match an IAM key made at start), keeps objects in memory and spills large
ones to temporary files. Its werkzeug server closes the connection after every response.

Fixtures (import them into a conftest): ``s3_server`` (one per xdist worker process, whole
session), ``s3_bucket`` (a fresh bucket per test, its ``s3://`` URL, emptied and removed after)
and ``s3_env`` (the server's ``AWS_*`` environment set in ``os.environ`` for one test).
"""

from __future__ import annotations

import json
import logging
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Iterator

import pytest

from tests.support.ports import free_port

log = logging.getLogger(__name__)

ACCESS_KEY = SECRET_KEY = "testing"
REGION = "us-east-1"
START_TIMEOUT_S = 30.0
_IAM_SETUP_CALLS = ("CreateUser", "PutUserPolicy", "CreateAccessKey")
_ORPHAN_MARKER = "DSPARK_ORPHAN_TEST_RUN"  # tests.support.processes.MARKER: never on our server


def _die_with_parent() -> None:
    """In the child before exec: SIGTERM when the process that started it dies, so a crashed test
    worker leaves no server behind (Linux; the parent *thread*: start it from a long-lived one)."""
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):  # not Linux: stop() still ends it
        pass


def client_options(
    endpoint: str, access_key: str = ACCESS_KEY, secret_key: str = SECRET_KEY, **extra
) -> dict:
    """The object-store client's storage options for an S3 server at ``endpoint`` (ours, or a fault
    proxy in front of it), with ``extra`` options."""
    return {
        "endpoint": endpoint,
        "access_key_id": access_key,
        "secret_access_key": secret_key,
        "region": REGION,
        **extra,
    }


class S3Server:
    """Moto's S3 server on ``127.0.0.1`` and a free port, started by :meth:`start` (or ``with``)."""

    def __init__(self, host: str = "127.0.0.1", port: int | None = None, *, check_credentials: bool = False,
                 server_env: dict[str, str] | None = None) -> None:
        """``check_credentials``: moto verifies every request's signature against an IAM user made
        at start (:attr:`access_key`, :attr:`secret_key`, in :meth:`env`), so wrong credentials get
        403 ``InvalidAccessKeyId``/``SignatureDoesNotMatch``; off, moto accepts any signature.
        ``server_env``: extra environment for the server process."""
        self.host = host
        self.check_credentials = check_credentials
        self.server_env = dict(server_env or {})
        self.access_key, self.secret_key = ACCESS_KEY, SECRET_KEY
        self._want_port = port
        self.port: int | None = None
        self._proc: subprocess.Popen | None = None
        self._log_file: tempfile._TemporaryFileWrapper | None = None

    @property
    def endpoint(self) -> str:
        if self.port is None:
            raise RuntimeError("S3Server not started")
        return f"http://{self.host}:{self.port}"

    def options(self, endpoint: str | None = None, **extra) -> dict:
        """The object-store client's storage options for this server, or for a proxy in front of it at
        ``endpoint`` (no AWS_* variable needed: producers the tests start with them are forked warm)."""
        return client_options(endpoint or self.endpoint, self.access_key, self.secret_key, **extra)

    def env(self) -> dict[str, str]:
        """The environment a client process needs to reach this server (botocore/s3fs and obstore
        both read ``AWS_ENDPOINT_URL``); no profile or config file of the user's is read."""
        return {
            "AWS_ENDPOINT_URL": self.endpoint,
            "AWS_ACCESS_KEY_ID": self.access_key,
            "AWS_SECRET_ACCESS_KEY": self.secret_key,
            "AWS_DEFAULT_REGION": REGION,
            "AWS_REGION": REGION,
            "AWS_ALLOW_HTTP": "true",
            "AWS_EC2_METADATA_DISABLED": "true",
            "AWS_CONFIG_FILE": os.devnull,
            "AWS_SHARED_CREDENTIALS_FILE": os.devnull,
        }

    # -- lifecycle ---------------------------------------------------------------------------

    def start(self) -> S3Server:
        if self._proc is not None:
            return self
        attempts = 1 if self._want_port else 3
        for attempt in range(attempts):
            self.port = self._want_port or free_port()
            self._spawn()
            try:
                self._wait_ready()
                if self.check_credentials:
                    self._make_credentials()
                log.info("moto S3 server pid %d at %s", self._proc.pid, self.endpoint)
                return self
            except RuntimeError as exc:
                tail = self.stderr_tail()
                self.stop()
                if "Address already in use" in tail and attempt + 1 < attempts:
                    log.warning("port %s taken before moto bound it; trying another", self.port)
                    continue
                raise RuntimeError(f"{exc}\n--- moto server output (tail) ---\n{tail}") from None
        raise AssertionError("unreachable")

    def _spawn(self) -> None:
        # Output goes to a file, never a pipe nobody reads: moto logs a line per request and a
        # full pipe would block the server.
        self._log_file = tempfile.NamedTemporaryFile(prefix="moto-s3-", suffix=".log", delete=False)
        env = {k: v for k, v in os.environ.items() if k != _ORPHAN_MARKER}
        env.update(self.env())
        env.pop("AWS_ENDPOINT_URL")  # the server itself must not point at itself
        env.setdefault("PYTHONUNBUFFERED", "1")
        if self.check_credentials:  # the IAM calls of _make_credentials go unchecked
            env["INITIAL_NO_AUTH_ACTION_COUNT"] = str(len(_IAM_SETUP_CALLS))
        env.update(self.server_env)
        cmd = [sys.executable, "-m", "moto.server", "-H", self.host, "-p", str(self.port)]
        self._proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=self._log_file,
                                      stderr=subprocess.STDOUT, env=env, preexec_fn=_die_with_parent)

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + START_TIMEOUT_S
        while True:
            code = self._proc.poll()
            if code is not None:
                raise RuntimeError(f"moto server exited with code {code} before answering on {self.endpoint}")
            try:  # moto's own API: answers without credentials even when moto checks them
                with urllib.request.urlopen(self.endpoint + "/moto-api/config", timeout=1):
                    return
            except urllib.error.HTTPError:  # it answers, if not with 200
                return
            except (urllib.error.URLError, ConnectionError, socket.timeout, OSError):
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(
                    f"moto server did not answer on {self.endpoint} within {START_TIMEOUT_S:.0f} s"
                )
            time.sleep(0.05)

    def stop(self, timeout: float = 5.0) -> None:
        """SIGTERM, then SIGKILL after ``timeout``; safe to call again or on a server never started."""
        proc, self._proc = self._proc, None
        if proc is not None and proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(timeout)
            except subprocess.TimeoutExpired:
                log.warning("moto server pid %d ignored SIGTERM; killing it", proc.pid)
                proc.kill()
                proc.wait()
        elif proc is not None:
            proc.wait()
        if self._log_file is not None:
            self._log_file.close()
            try:
                os.unlink(self._log_file.name)
            except FileNotFoundError:
                pass
            self._log_file = None

    @property
    def running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def stderr_tail(self, lines: int = 30) -> str:
        """The last lines the server wrote (what to show when it failed)."""
        if self._log_file is None:
            return ""
        self._log_file.flush()
        with open(self._log_file.name, "rb") as handle:
            handle.seek(max(0, os.path.getsize(self._log_file.name) - 64 * 1024))
            return "\n".join(handle.read().decode(errors="replace").splitlines()[-lines:])

    def __enter__(self) -> S3Server:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # -- state -------------------------------------------------------------------------------

    def _request(self, method: str, path: str, timeout: float = 30) -> bytes:
        data = b"" if method in ("PUT", "POST") else None
        req = urllib.request.Request(self.endpoint + path, method=method, data=data)
        try:
            with urllib.request.urlopen(req, timeout=timeout) as resp:
                return resp.read()
        except urllib.error.HTTPError as exc:  # say what moto said (e.g. InvalidBucketName)
            raise RuntimeError(
                f"{method} {path}: HTTP {exc.code}: {exc.read().decode(errors='replace')}"
            ) from None

    def make_bucket(self, name: str) -> str:
        """Create bucket ``name``; returns ``"s3://name"``."""
        if self.check_credentials:
            self.boto3_client().create_bucket(Bucket=name)
        else:  # moto takes an unsigned bucket creation: no boto3 import
            self._request("PUT", f"/{name}")
        return f"s3://{name}"

    def reset(self) -> None:
        """Wipe every bucket and object (moto's ``POST /moto-api/reset``). With
        ``check_credentials`` IAM is wiped too and new credentials are made: call :meth:`env` again."""
        self._request("POST", "/moto-api/reset")
        if self.check_credentials:
            body = str(len(_IAM_SETUP_CALLS)).encode()  # moto reads the bare number
            req = urllib.request.Request(self.endpoint + "/moto-api/reset-auth", data=body, method="POST",
                                         headers={"Content-Type": "text/plain"})  # not form data
            urllib.request.urlopen(req, timeout=30).close()
            self._make_credentials()

    def boto3_client(self, service: str = "s3"):
        """A boto3 client for this server (imports boto3, which moto brings along)."""
        import boto3

        return boto3.client(service, endpoint_url=self.endpoint, aws_access_key_id=self.access_key,
                            aws_secret_access_key=self.secret_key, region_name=REGION)

    def _make_credentials(self) -> None:
        """An IAM user allowed everything, and its access key (the only requests moto lets through
        unchecked: :data:`_IAM_SETUP_CALLS`)."""
        iam = self.boto3_client("iam")
        iam.create_user(UserName="tests")
        iam.put_user_policy(UserName="tests", PolicyName="everything", PolicyDocument=json.dumps(
            {"Version": "2012-10-17", "Statement": [{"Effect": "Allow", "Action": "*", "Resource": "*"}]}))
        key = iam.create_access_key(UserName="tests")["AccessKey"]
        self.access_key, self.secret_key = key["AccessKeyId"], key["SecretAccessKey"]

    def remove_bucket(self, name: str) -> None:
        """Abort its multipart uploads, delete its objects, then the bucket (moto keeps everything
        in memory or temp files for the whole session otherwise)."""
        client = self.boto3_client()
        for page in client.get_paginator("list_multipart_uploads").paginate(Bucket=name):
            for upload in page.get("Uploads", []):
                client.abort_multipart_upload(Bucket=name, Key=upload["Key"], UploadId=upload["UploadId"])
        for page in client.get_paginator("list_objects_v2").paginate(Bucket=name):
            keys = [{"Key": obj["Key"]} for obj in page.get("Contents", [])]
            if keys:
                client.delete_objects(Bucket=name, Delete={"Objects": keys, "Quiet": True})
        client.delete_bucket(Bucket=name)


def unique_bucket_name(prefix: str = "test") -> str:
    """A valid S3 bucket name (3-63 lowercase letters, digits, hyphens) no other test uses."""
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


@pytest.fixture(scope="session")
def s3_server() -> Iterator[S3Server]:
    """One moto server per test process (each xdist worker starts its own), stopped at the end."""
    with S3Server() as server:
        yield server


@pytest.fixture
def s3_bucket(s3_server: S3Server) -> Iterator[str]:
    """A fresh, empty bucket for this test: its ``s3://`` URL. Emptied and removed afterwards."""
    name = unique_bucket_name()
    url = s3_server.make_bucket(name)
    yield url
    if s3_server.running:
        try:
            s3_server.remove_bucket(name)
        except Exception as exc:  # a test that broke the bucket must not fail in teardown
            log.warning("could not remove bucket %s: %s", name, exc)


@pytest.fixture
def s3_env(s3_server: S3Server, monkeypatch: pytest.MonkeyPatch) -> dict[str, str]:
    """The server's ``AWS_*`` environment in ``os.environ`` for this test (and the processes it
    starts), credentials of the user's own unset; returns what was set."""
    for key in ("AWS_PROFILE", "AWS_DEFAULT_PROFILE", "AWS_SESSION_TOKEN", "AWS_SECURITY_TOKEN",
                "AWS_ENDPOINT_URL_S3", "AWS_ENDPOINT", "AWS_WEB_IDENTITY_TOKEN_FILE", "AWS_ROLE_ARN",
                "AWS_CONTAINER_CREDENTIALS_RELATIVE_URI", "AWS_CONTAINER_CREDENTIALS_FULL_URI"):
        monkeypatch.delenv(key, raising=False)
    env = s3_server.env()
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    return env
