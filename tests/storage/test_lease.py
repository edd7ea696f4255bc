"""The lease's edge cases as a table, fast: on obstore's in-memory store (conditional writes
included), with real Lease objects, real processes for the holders' pids, and no clock faked but the
records' own times."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time

import pytest

from dspark_cache.format.paths import LEASE
from dspark_cache.format.schema import Lease as LeaseRecord, decode_json, encode_json
from dspark_cache.storage.lock import CacheLockedError
from dspark_cache.storage.remote.lease import Lease, node_identity
from tests.support.remote import memory_store

HOUR = 3600.0


@pytest.fixture(scope="module")
def dead_pid() -> int:
    """The pid of a process of this host that has exited (and was reaped)."""
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return child.pid


def _record(**fields) -> LeaseRecord:
    now = time.time()
    base = dict(host="elsewhere", pid=7, run_id="theirs", started_at=now, renewed_at=now, ttl=HOUR,
                node="another-boot/pid:[1]")
    return LeaseRecord(**{**base, **fields})


def _held(store) -> LeaseRecord:
    return decode_json(store.get(LEASE)[0], LeaseRecord)


# The lease found on the store, how long a taker waits, and what becomes of it: taken (by whom it was
# held before, in the log) or refused naming its holder.
LONG_AGO = -2 * HOUR  # renewed_at relative to now
HOLDERS = {
    "none": (None, 0.0, "taken"),
    "expired": (lambda pid: _record(renewed_at=time.time() + LONG_AGO, ttl=0.0), 0.0, "taken"),
    "expiring while waited for": (lambda pid: _record(ttl=0.3), 10.0, "taken"),
    "dead holder on this host": (
        lambda pid: _record(host=socket.gethostname(), pid=pid, node=node_identity()), 0.0, "taken"),
    "live holder elsewhere": (lambda pid: _record(), 0.3, "refused"),
    "live holder on this host": (
        lambda pid: _record(pid=os.getppid(), node=node_identity()), 0.3, "refused"),
    "holder's clock behind": (
        lambda pid: _record(renewed_at=time.time() + LONG_AGO, ttl=60.0), 0.3, "refused"),
    "not a lease": (lambda pid: b"{not json", 0.3, "refused"),
}


@pytest.mark.parametrize("case", HOLDERS)
def test_taking_a_lease(case, dead_pid, caplog):
    """Free, expired or dead on this host: taken at once; expiring while waited for: taken then. Held by
    a live process (here or elsewhere), renewed by a holder whose clock is behind (the store's
    Last-Modified is now), or unreadable: waited for, at most the wait given, then refused naming the
    lease and its holder."""
    planted, wait, outcome = HOLDERS[case]
    store, _ = memory_store()
    if planted is not None:
        found = planted(dead_pid)
        store.put(LEASE, found if isinstance(found, bytes) else encode_json(found))
    lease = Lease(store, "ours", ttl=HOUR)
    caplog.set_level("WARNING")
    if outcome == "refused":
        started = time.monotonic()
        with pytest.raises(CacheLockedError) as refused:
            lease.take(wait=wait)
        assert time.monotonic() - started >= wait  # waited, then gave up
        message = str(refused.value)
        assert "is in use by another dspark-produce run" in message and store.name(LEASE) in message
        assert "--lease-wait" in message and lease.lost is None
        if case != "not a lease":
            assert f"pid {_held(store).pid}" in message
        return
    lease.take(wait=wait)
    try:
        held = _held(store)
        assert (held.run_id, held.pid, held.node) == ("ours", os.getpid(), node_identity())
        if planted is not None:
            why = "is dead (this host)" if "dead" in case else "stopped renewing"
            assert any("took over the lease" in r.message and why in r.message for r in caplog.records)
    finally:
        lease.release()
    assert store.head(LEASE) is None  # given back


def test_a_renewal_after_another_took_over_loses_the_lease():
    """The store refuses the renewal (412: the version renewed is not the one there): the lease is lost,
    naming who holds it now, and nothing may be published (check raises)."""
    store, _ = memory_store()
    lease = Lease(store, "ours", ttl=HOUR)
    lease.take(wait=0)
    try:
        store.put(LEASE, encode_json(_record(run_id="usurper")))  # another producer's takeover
        lease.renew()
        assert lease.lost is not None and "another producer took it over" in lease.lost
        assert "usurper" in lease.lost
        with pytest.raises(CacheLockedError, match="lost its lease"):
            lease.check()
    finally:
        lease.release()
    assert _held(store).run_id == "usurper"  # a lost lease is not deleted on release


def test_a_renewal_after_the_lease_was_deleted_loses_it():
    store, _ = memory_store()
    lease = Lease(store, "ours", ttl=HOUR)
    lease.take(wait=0)
    try:
        store.delete(LEASE)
        lease.renew()
        assert lease.lost is not None and "nobody: it was deleted" in lease.lost
    finally:
        lease.release()


def test_a_renewal_racing_a_takeover_one_wins():
    """A taker reads the lease as expired; its holder renews before the takeover's write arrives: the
    takeover (If-Match on the version read) is refused, the taker reads again and takes the renewed
    version over only as a whole new race, and the holder's next renewal then loses. At no point do
    both hold it."""
    holder_store, _ = memory_store()
    holder = Lease(holder_store, "holder", ttl=HOUR)
    holder.take(wait=0)
    holder.record.ttl = 0.0  # its record reads as expired to any taker: every read invites a takeover
    holder.renew()

    taker_store, taker_client = memory_store(holder_store._store)
    taker_client.before_match = holder.renew  # lands between the taker's read and its takeover's write
    taker = Lease(taker_store, "taker", ttl=HOUR)
    try:
        taker.take(wait=0)
        assert taker_client.before_match is None and taker_client.matches == 2  # lost once, read again
        assert holder.lost is None  # its renewal landed: until the taker's second try it held the lease
        assert _held(holder_store).run_id == "taker"
        holder.renew()
        assert holder.lost is not None and "taker" in holder.lost
    finally:
        taker.release()
        holder.release()


@pytest.mark.parametrize("step", ["take", "takeover", "renewal"])
def test_a_412_from_our_own_retry_is_recognised_as_ours(step):
    """The write landed, its answer was lost and the client's retry of it lost to it (412): the store holds
    exactly what we sent, so the lease is ours (not "in use by another run" naming our own pid, not
    lost), and the ETag kept is the one a renewal must match."""
    store, client = memory_store()
    if step == "takeover":
        store.put(LEASE, encode_json(_record(ttl=0.0)))
    lease = Lease(store, "ours", ttl=HOUR)
    client.lose_answers = 1 if step != "renewal" else 0
    lease.take(wait=0)
    try:
        if step == "renewal":
            client.lose_answers = 1
            lease.renew()
        assert client.lose_answers == 0 and lease.lost is None
        assert _held(store).renewed_at == lease.record.renewed_at
        lease.renew()  # over the ETag recognised: the right one
        assert lease.lost is None
    finally:
        lease.release()
    assert store.head(LEASE) is None  # given back: it was ours
