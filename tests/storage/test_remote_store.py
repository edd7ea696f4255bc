"""The object-store door (``storage/remote/store.py``) and the lease (``storage/remote/lease.py``) against the
moto S3 server, with the fault proxy in front where an answer must be lost: conditional writes whose
answer never came, keys the client cannot represent, client options given where users put them, and a
panic of the client library."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest

from dspark_cache.format.paths import LEASE
from dspark_cache.storage.remote.lease import Lease
from dspark_cache.storage.remote.store import ConditionFailedError, ObjectStore, UnrepresentableKeyError
from dspark_cache.storage.remote.url import RemoteURL
from tests.support.faultproxy import Request
from tests.support.remote import KEYS, upload_cache
from tests.support.s3server import client_options

ARGS = ("--shard-size", "6")


def _lease_put(conditional: str):
    """A PUT of the lease with an ``If-Match`` (a takeover or renewal) or ``If-None-Match`` (a take)."""
    def match(req: Request) -> bool:
        return req.method == "PUT" and req.path.endswith("/" + LEASE) and conditional in req.headers
    return match


# -- 2. a lease write whose answer is lost ------------------------------------------------------

@pytest.mark.parametrize("lost", ["drop", "drop500"])
def test_a_takeover_whose_answer_is_lost_is_recognised_as_ours(s3_server, s3_bucket, proxy, lost, caplog):
    """The takeover of an expired lease lands, its answer is lost (a reset: the client does not retry;
    a 500: the client retries into 412): the store holds what we sent, so the lease is ours, never
    "in use by another run" naming our own pid."""
    store = ObjectStore(f"{s3_bucket}/cache", client_options(proxy.endpoint))
    gone = {"host": "elsewhere", "pid": 7, "run_id": "old", "world_size": 1, "started_at": 0.0,
            "renewed_at": time.time() - 10, "ttl": 1.0, "node": "another-boot/pid:[1]"}
    store.put(LEASE, json.dumps(gone).encode())
    proxy.fail_next(1, lost, match=_lease_put("if-match"))
    lease = Lease(store, "run-ours", ttl=30)
    lease.take(wait=10)  # its Last-Modified is now: it expires in a second
    try:
        assert proxy.faults[lost] == 1
        held = json.loads(ObjectStore(f"{s3_bucket}/cache", client_options(s3_server.endpoint)).get(LEASE)[0])
        assert (held["run_id"], held["pid"]) == ("run-ours", os.getpid())
        assert lease.lost is None
        lease.renew()  # renewed over the version the store holds: the ETag recognised is the right one
        assert lease.lost is None
    finally:
        lease.release()
    assert store.head(LEASE) is None  # given back: it was ours


@pytest.mark.parametrize("lost", ["drop", "drop500"])
def test_a_take_and_a_renewal_whose_answers_are_lost_are_ours(s3_bucket, proxy, lost):
    store = ObjectStore(f"{s3_bucket}/cache", client_options(proxy.endpoint))
    proxy.fail_next(1, lost, match=_lease_put("if-none-match"))
    lease = Lease(store, "run-ours", ttl=30)
    lease.take(wait=0)
    try:
        proxy.fail_next(1, lost, match=_lease_put("if-match"))
        lease.renew()
        assert proxy.faults[lost] == 2 and lease.lost is None
        assert json.loads(store.get(LEASE)[0])["renewed_at"] == lease.record.renewed_at
    finally:
        lease.release()
    assert store.head(LEASE) is None


def test_conditional_writes_refuse_what_they_must(s3_server, s3_bucket):
    """What makes a late commit fail: a create over an object, a match over a version replaced or
    deleted since; and what makes a lost answer harmless: the same bytes again are ours."""
    store = ObjectStore(f"{s3_bucket}/cache", client_options(s3_server.endpoint))
    first = store.put(KEYS.shard_index(0), b"mine", create=True)
    assert store.put(KEYS.shard_index(0), b"mine", create=True) == first  # ours already: the same bytes
    with pytest.raises(ConditionFailedError):
        store.put(KEYS.shard_index(0), b"a late one", create=True)
    second = store.put(KEYS.shard_index(0), b"replaced", match=first)
    with pytest.raises(ConditionFailedError):
        store.put(KEYS.shard_index(0), b"late", match=first)  # If-Match on a version replaced since
    store.delete(KEYS.shard_index(0))
    with pytest.raises(ConditionFailedError):
        store.put(KEYS.shard_index(0), b"late", match=second)  # If-Match on a version deleted since
    assert store.head(KEYS.shard_index(0)) is None


# -- 4. keys the client cannot represent --------------------------------------------------------

def test_listings_skip_and_name_keys_the_client_cannot_represent(local_cache_url, s3_server, caplog):
    url, store = local_cache_url
    parsed = RemoteURL.parse(url)
    client = s3_server.boto3_client()
    mine = dict(store.walk())
    odd = ["a//b", "./x", "ctl\x01z", "shards/x//y", "notes/../n"]
    for key in odd:
        client.put_object(Bucket=parsed.bucket, Key=f"{parsed.prefix}/{key}", Body=b"not ours")
    caplog.set_level("WARNING")
    fresh = ObjectStore(url, s3_server.options())
    assert dict(fresh.walk()) == mine  # every file of the cache, none of the odd keys
    assert fresh.list(KEYS.shards_dir) == {name.split("/", 1)[1]: info for name, info in mine.items()
                                           if name.startswith(KEYS.shards_dir + "/")}
    named = [r.getMessage() for r in caplog.records if "cannot represent" in r.getMessage()]
    assert named and all(m.startswith(f"s3://{parsed.bucket}/{parsed.prefix}/") for m in named), named
    assert not any("check the network" in r.getMessage() for r in caplog.records)
    # One right in a directory of the cache's own: the failed listing would hide which files: refused by name.
    client.put_object(Bucket=parsed.bucket, Key=f"{parsed.prefix}/shards/odd\x02", Body=b"x")
    said = r"shards/: it holds the key .*shards/odd\\x02.*rename or delete"
    with pytest.raises(UnrepresentableKeyError, match=said):
        fresh.list(KEYS.shards_dir)


@pytest.fixture
def local_cache_url(produced, s3_server, s3_bucket) -> tuple[str, ObjectStore]:
    url = f"{s3_bucket}/runs/cache"
    return url, upload_cache(produced(*ARGS), url, storage_options=s3_server.options())


# -- 5. client options at the top level; a panic of the client ----------------------------------

def _verify(url: str, options: dict, node, env: dict | None = None) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "dspark_cache.verify", url, "--json", "--storage-options",
           json.dumps(options), "--local-cache-dir", str(node)]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "RUST_BACKTRACE": "1", **(env or {})})


def _one_line(stderr: str) -> None:
    assert "Traceback" not in stderr and "stack backtrace" not in stderr, stderr
    assert sum("panicked at" in line for line in stderr.splitlines()) <= 1, stderr


def test_client_options_at_the_top_level_are_accepted(local_cache_url, s3_server, tmp_path):
    url, _ = local_cache_url
    options = client_options(s3_server.endpoint, allow_http=True, timeout="120s", AWS_CONNECT_TIMEOUT="5s",
                       max_retries=3, retry_timeout=60)
    done = _verify(url, options, tmp_path / "node")
    _one_line(done.stderr)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout.strip().splitlines()[-1])["ok"]


def test_an_unknown_or_doubled_option_is_refused_by_name(local_cache_url, s3_server, tmp_path):
    url, _ = local_cache_url
    for extra, said in [({"bogus_key": 1}, "the storage option 'bogus_key' is not one"),
                        ({"timeout": "5s", "client_options": {"timeout": "9s"}},
                         "timeout is given both at the top level and in client_options")]:
        done = _verify(url, client_options(s3_server.endpoint, **extra), tmp_path / "node")
        _one_line(done.stderr)
        assert done.returncode != 0
        errors = [line for line in done.stderr.splitlines() if "error" in line]
        assert len(errors) == 1 and said in errors[0], done.stderr


_PANIC = """
import sys
import dspark_cache.storage.remote.client as client
# Labelled stand-in: every panic of obstore's configuration known today comes from an HTTP-client key
# given among the store's keys, which _client_settings now moves; skipping that step, the client panics.
client._client_settings = lambda config: (dict(config), {}, None)
from dspark_cache.cli import verify
sys.exit(verify(sys.argv[1:]))
"""


def test_a_panic_of_the_client_library_is_one_line(local_cache_url, s3_server, tmp_path):
    url, _ = local_cache_url
    cmd = [sys.executable, "-c", _PANIC, url, "--storage-options",
           json.dumps(client_options(s3_server.endpoint, aws_allow_http=True)), "--local-cache-dir",
           str(tmp_path / "n")]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "RUST_BACKTRACE": "1"})
    _one_line(done.stderr)
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1, done.stderr
    assert "the object-store client failed on its configuration (PanicException" in lines[0], lines
    assert done.returncode != 0
