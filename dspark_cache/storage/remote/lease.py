"""One producer per cache on object storage, without ``flock``: a lease object, ``control/lease.json``.

An object store has no locks, but it has conditional writes. The lease is *taken* by creating the
object only where none exists (``If-None-Match: *``), *renewed* by rewriting it only over the
version its holder wrote (``If-Match`` on that ETag), and *free* once ``ttl`` seconds have passed
since its last renewal: a producer killed with SIGKILL stops renewing, and the next one takes the
expired lease over, again with ``If-Match``, so that of two producers racing for it one wins.

Expiry is judged against the later of the holder's own ``renewed_at`` and the store's
``Last-Modified`` of the object, so a holder whose clock is behind is not thought dead early.

A holder that cannot renew for a whole ``ttl`` (the store unreachable, or someone else took the
lease) has *lost* it: :meth:`Lease.check` then raises, and the producer publishes nothing more.

A lease whose holder's process is gone is taken over at once where that can be seen: the holder ran
on this machine, in this pid namespace (``node``: the boot id and the namespace), and its pid is
dead (a job requeued after a preemption on the same node). Otherwise a producer that finds the lease
held waits for it to be given back or to expire, for at most ``wait`` seconds (``--lease-wait``),
saying how long, then gives up naming the lease.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time

import msgspec

from dspark_cache.format.errors import CacheError
from dspark_cache.format.paths import LEASE
from dspark_cache.format.schema import Lease as LeaseRecord, decode_json, encode_json
from dspark_cache.storage.lock import CacheLockedError, describe_holder
from dspark_cache.storage.remote.node import process_alive
from dspark_cache.storage.remote.store import ConditionFailedError, ObjectInfo, ObjectStore, ObjectStoreError

log = logging.getLogger(__name__)

TTL = 60.0  # seconds a lease lives without a renewal
WAIT_MARGIN = 30.0  # the default wait for a held lease: its ttl and this (its holder's clock may lag)
_MAX_LEASE_BYTES = 1 << 16
_POLL = 2.0  # seconds between looks at a lease waited for
_RACES = 5  # conditional writes lost to other takers before giving up


def _ttl() -> float:
    """``DSPARK_LEASE_TTL`` (seconds), for clusters whose stores are slow to answer, and for tests."""
    try:
        return max(1.0, float(os.environ.get("DSPARK_LEASE_TTL", TTL)))
    except ValueError:
        return TTL


def _read(store: ObjectStore) -> tuple[LeaseRecord | None, ObjectInfo] | None:
    """The lease and its object's info; ``None`` when there is none; a record of ``None`` when the
    object is not a lease we can read (it is then treated as held until it expires by its age)."""
    got = store.get(LEASE, limit=_MAX_LEASE_BYTES)
    if got is None:
        return None
    data, info = got
    try:
        return decode_json(data, LeaseRecord), info
    except (msgspec.DecodeError, CacheError):
        return None, info


def node_identity() -> str:
    """This process's machine and pid namespace, as a lease records them (``""`` where unknown): a pid
    means the same process only within one."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as handle:
            boot = handle.read().strip()
        return f"{boot}/{os.readlink('/proc/self/ns/pid')}"
    except OSError:
        return ""


def holder_gone(record: LeaseRecord | None) -> bool:
    """The holder ran on this machine, in this pid namespace, and its process is gone."""
    here = node_identity()
    return record is not None and bool(here) and record.node == here and record.pid != os.getpid() \
        and not process_alive(record.pid)


def _expires_at(record: LeaseRecord | None, info: ObjectInfo) -> float:
    renewed = max(record.renewed_at if record is not None else 0.0, info.modified)
    return renewed + (record.ttl if record is not None else TTL)


def describe_lease(record: LeaseRecord | None, info: ObjectInfo, now: float) -> str:
    holder = describe_holder(msgspec.to_builtins(record) if record is not None else None)
    left = _expires_at(record, info) - now
    return (
        f"{holder}; its lease was renewed {max(0.0, now - info.modified):.0f} s ago and expires in {left:.0f} s "
        "unless renewed"
    )


def _advice(store: ObjectStore, left: float) -> str:
    lease = store.name(LEASE)
    return (f"Two producers on one cache would redo and overwrite each other's work. If that run is alive, "
            f"wait for it to finish or stop it (dspark-monitor {store.url}, key s); if it is gone (killed, "
            f"preempted), its lease {lease} expires by itself in {max(0.0, left):.0f} s: rerun then, or give "
            "--lease-wait a longer wait, or delete that object once sure no producer of it runs. For a "
            "separate cache choose another --output-dir")


class Lease:
    """This producer's hold on a remote cache: :meth:`take` it, keep it renewed (a daemon thread) until
    :meth:`release`; :meth:`check` raises once it is lost."""

    def __init__(
        self, store: ObjectStore, run_id: str, world_size: int = 1, ttl: float | None = None
    ) -> None:
        self.store = store
        self.ttl = ttl if ttl is not None else _ttl()
        now = time.time()
        self.record = LeaseRecord(
            host=socket.gethostname(),
            pid=os.getpid(),
            run_id=run_id,
            world_size=world_size,
            started_at=now,
            renewed_at=now,
            ttl=self.ttl,
            node=node_identity(),
        )
        self._etag: str | None = None
        self._renewed = 0.0  # when the store last accepted a renewal (this machine's clock)
        self._lost: str | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    # -- taking -------------------------------------------------------------------------------

    def take(self, *, overwrite: bool = False, wait: float | None = None) -> None:
        """Hold the lease, or raise :class:`CacheLockedError` naming it and its holder. A lease held by a
        live (or unknown) holder is waited for, ``wait`` seconds at most (default: its ttl and
        ``WAIT_MARGIN``, enough for the lease of a job that was killed to expire)."""
        started = time.monotonic()  # the lease lives from before the request, as the store may count it
        deadline: float | None = None if wait is None else started + max(0.0, wait)
        told = False
        races = 0
        while True:
            attempt = time.monotonic()
            try:  # a write whose answer was lost and retried into a refusal is ours (ObjectStore.put)
                self._etag = self.store.put(LEASE, self._encode(), create=True)
                break
            except ConditionFailedError:
                pass
            found = _read(self.store)
            if found is None:  # released meanwhile: raced for again
                races = self._raced(races)
                continue
            record, info = found
            now = time.time()
            gone = holder_gone(record)
            if gone or now >= _expires_at(record, info):
                attempt = time.monotonic()
                try:  # expired, or its holder is dead: take it over, unless another producer does so first
                    self._etag = self.store.put(LEASE, self._encode(), match=info.etag)
                except ConditionFailedError:
                    races = self._raced(races)
                    continue
                holder = describe_holder(msgspec.to_builtins(record) if record is not None else None)
                why = f"its holder's pid {record.pid} is dead (this host)" if gone and record is not None \
                    else "it stopped renewing it"
                log.warning("took over the lease on %s from %s: %s", self.store.url, holder, why)
                break
            left = _expires_at(record, info) - now
            if deadline is None:
                deadline = started + (record.ttl if record is not None else TTL) + WAIT_MARGIN
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                what = "--overwrite refused: it does not stop a live run, and " if overwrite else ""
                waited = f" (waited {time.monotonic() - started:.0f} s, --lease-wait)" if told else ""
                raise CacheLockedError(
                    f"{what}{self.store.url} is in use by another dspark-produce run: its lease "
                    f"{self.store.name(LEASE)} is held by {describe_lease(record, info, now)}{waited}. "
                    + _advice(self.store, left))
            if not told:
                told = True
                log.warning("%s: its lease %s is held by %s; waiting up to %.0f s for it to be given back or "
                            "to expire (--lease-wait)", self.store.url, self.store.name(LEASE),
                            describe_lease(record, info, now), remaining)
            time.sleep(max(0.05, min(_POLL, remaining, left + 0.1)))
        self._renewed = attempt
        self._thread = threading.Thread(target=self._keep, name="dspark-lease", daemon=True)
        self._thread.start()

    def _raced(self, races: int) -> int:
        """One more race for the lease lost to another producer; raise once there were too many."""
        if races + 1 >= _RACES:
            raise CacheLockedError(f"{self.store.url}: another producer keeps taking its lease "
                                   f"({self.store.name(LEASE)}); rerun when it is done")
        return races + 1

    def _encode(self) -> bytes:
        self.record.renewed_at = time.time()
        return encode_json(self.record)

    # -- keeping ------------------------------------------------------------------------------

    def _keep(self) -> None:
        while not self._stop.wait(self.ttl / 6):
            self.renew()

    def renew(self) -> None:
        """Rewrite the lease over our own version (what the thread does every ``ttl / 6`` s)."""
        if self._lost is not None:
            return
        started = time.monotonic()
        try:
            self._etag = self.store.put(LEASE, self._encode(), match=self._etag)
            self._renewed = started
        except ConditionFailedError:  # not ours (ObjectStore.put recognises our own write landed)
            found = _read(self.store)
            holder = (describe_lease(*found, time.time()) if found is not None else "nobody: it was deleted")
            self._lose(f"another producer took it over ({holder})")
        # the store did not answer: try again; past the ttl it may be someone else's
        except CacheError as exc:
            if time.monotonic() - self._renewed > self.ttl:
                self._lose(f"it could not be renewed for {self.ttl:.0f} s ({exc})")
            else:
                log.warning("renewing the lease on %s failed (%s); retrying", self.store.url, exc)

    @property
    def lost(self) -> str | None:
        """Why the lease was lost, or ``None`` while it is held."""
        return self._lost

    def _lose(self, why: str) -> None:
        self._lost = why
        log.error("lost the lease on %s: %s; publishing stops", self.store.url, why)

    def check(self) -> None:
        """Raise once the lease is lost: nothing may be published without it."""
        if self._lost is None and self._thread is not None and time.monotonic() - self._renewed > self.ttl:
            self._lose(f"it was not renewed for {self.ttl:.0f} s")
        if self._lost is not None:
            raise CacheLockedError(f"{self.store.url}: this producer lost its lease ({self._lost}); what it "
                                   "published is kept. Rerun when no other producer writes the cache")

    def fence(self) -> None:
        """Return once the last renewal is at most half the ttl old, so that a commit made now lands well
        before another producer could take the lease over (waits while the store is slow to renew);
        raise once the lease is lost."""
        while True:
            self.check()
            if self._thread is None or time.monotonic() - self._renewed <= self.ttl / 2:
                return
            time.sleep(0.2)

    # -- letting go ---------------------------------------------------------------------------

    def release(self) -> None:
        """Stop renewing and delete the lease, if it is still ours."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self._etag is None or self._lost is not None or time.monotonic() - self._renewed > self.ttl / 2:
            return  # not ours, or perhaps no longer: someone may hold it since (it expires by itself)
        try:
            found = _read(self.store)
            if found is not None and found[1].etag == self._etag:
                self.store.delete(LEASE)
        except ObjectStoreError as exc:  # it expires by itself
            log.warning(
                "could not delete the lease on %s (%s); it expires in %.0f s", self.store.url, exc, self.ttl
            )
        self._etag = None
