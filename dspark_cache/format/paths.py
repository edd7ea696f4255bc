"""Where every file of a cache lives. The only place that knows file names."""

from __future__ import annotations

import os
import re
from dataclasses import dataclass

MANIFEST = "manifest.json"
TARGET_WEIGHTS = "target_weights.safetensors"
SHARDS_DIR = "shards"
STATUS_DIR = "status"
EVENTS_DIR = "events"
CONTROL_DIR = "control"
STOP_REQUEST = f"{CONTROL_DIR}/stop"
LOCK = f"{CONTROL_DIR}/lock"  # flock-ed by the producer job that owns the directory
LEASE = f"{CONTROL_DIR}/lease.json"  # on object storage: the producer job's lease (storage/remote/lease.py)
STAGING_MARK = ".dspark-staging"  # in a staging directory: the URL whose cache it stages
STAGING_RECORDS = ".dspark-staging-records"  # and its bookkeeping as a copy of the store's (remote.localdir)
CLAIM_PREFIX = "complete-"  # control/complete-<run id>: the one rank that marks a run's cache complete
LOGS_DIR = "logs"  # the producer's own log when it runs under the monitor (--tui)
PLAN_DIR = "plan"  # the tokenised input and its batching, kept for reruns (producer/plan/store.py)
PLAN_HEADER = f"{PLAN_DIR}/plan.json"
PLAN_ARRAYS = ("samples", "batches", "shards", "shard_bytes")  # the merged plan's arrays
PLAN_PART_KINDS = ("ids", "mask", "rows")  # a part's arrays
PARTIAL_SUFFIX = ".partial"
WIDS_INDEX = f"{SHARDS_DIR}/wids-index.json"  # wids' shard list (format/wids_index.py)

_SHARD_INDEX_RE = re.compile(r"^shard-(\d{6,})\.idx$")  # ids past 999999 take more digits
_SHARD_PARTIAL_RE = re.compile(r"^shard-(\d{6,})\.tar\.partial$")
_SHARD_FILE_RE = re.compile(r"^shard-(\d{6,})\.(idx|tar)$")
_EVENTS_SEGMENT_RE = re.compile(r"^rank-(\d{5,})\.jsonl\.(\d{6,})$")  # on object storage: events/ in segments
# Temporaries: format.atomic's f"{path}.{pid}.{thread}.tmp" (indexes, the wids list, manifest, status) and
# the plan's array writer's f"{path}.{pid}.tmp".
_TEMPORARY_RE = re.compile(r"^(.+?)(?:\.\d+){1,2}\.tmp$")


def temporary_base(name: str) -> str | None:
    """The file name whose ``format.atomic`` temporary ``name`` is, or None when it is not one."""
    temporary = _TEMPORARY_RE.match(name)
    return temporary.group(1) if temporary else None


def sample_key(sample_id: int) -> str:
    """The WebDataset key of a sample: dot-free, zero-padded, sortable, unique."""
    return f"{sample_id:010d}"


@dataclass(frozen=True)
class CachePaths:
    """File names inside one cache directory."""

    root: str

    @property
    def manifest(self) -> str:
        return os.path.join(self.root, MANIFEST)

    @property
    def target_weights(self) -> str:
        return os.path.join(self.root, TARGET_WEIGHTS)

    @property
    def shards_dir(self) -> str:
        return os.path.join(self.root, SHARDS_DIR)

    @property
    def status_dir(self) -> str:
        return os.path.join(self.root, STATUS_DIR)

    @property
    def events_dir(self) -> str:
        return os.path.join(self.root, EVENTS_DIR)

    @property
    def control_dir(self) -> str:
        return os.path.join(self.root, CONTROL_DIR)

    @property
    def logs_dir(self) -> str:
        return os.path.join(self.root, LOGS_DIR)

    @property
    def stop_request(self) -> str:
        return os.path.join(self.root, STOP_REQUEST)

    def completion_claim(self, run_id: str) -> str:
        return os.path.join(self.control_dir, f"{CLAIM_PREFIX}{run_id}")

    @staticmethod
    def is_completion_claim(name: str) -> bool:
        return name.startswith(CLAIM_PREFIX)

    @property
    def lock(self) -> str:
        return os.path.join(self.root, LOCK)

    @property
    def plan_dir(self) -> str:
        return os.path.join(self.root, PLAN_DIR)

    @property
    def plan_header(self) -> str:
        """The saved plan's header: its identity, totals and the checksum of every plan file."""
        return os.path.join(self.root, PLAN_HEADER)

    def plan_array(self, name: str) -> str:
        """One of the merged plan's arrays (``samples``, ``batches``, ``shards``), a ``.npy`` file."""
        return os.path.join(self.plan_dir, f"{name}.npy")

    def plan_part(self, part: int, kind: str) -> str:
        """Part ``part`` of the tokenised input (one per encoding rank): ``ids``, ``mask`` or ``rows``."""
        return os.path.join(self.plan_dir, f"part-{part:05d}.{kind}.npy")

    def plan_part_header(self, part: int) -> str:
        """Part ``part``'s header: its rows, checksums and skipped rows (written after its arrays)."""
        return os.path.join(self.plan_dir, f"part-{part:05d}.json")

    def shard_tar(self, shard_id: int) -> str:
        return os.path.join(self.shards_dir, f"shard-{shard_id:06d}.tar")

    def shard_partial(self, shard_id: int) -> str:
        return self.shard_tar(shard_id) + PARTIAL_SUFFIX

    def shard_index(self, shard_id: int) -> str:
        return os.path.join(self.shards_dir, f"shard-{shard_id:06d}.idx")

    @property
    def wids_index(self) -> str:
        """The ``wids-shard-index-v1`` JSON that ``wids.ShardListDataset`` opens (next to the shards)."""
        return os.path.join(self.root, WIDS_INDEX)

    def status(self, rank: int) -> str:
        return os.path.join(self.status_dir, f"rank-{rank:05d}.json")

    def events(self, rank: int) -> str:
        return os.path.join(self.events_dir, f"rank-{rank:05d}.jsonl")

    def events_segment(self, rank: int, segment: int) -> str:
        """Segment ``segment`` of rank ``rank``'s event log where it is an object (objects are not appended to:
        the log is uploaded as segments, each rewritten until it is full)."""
        return f"{self.events(rank)}.{segment:06d}"

    def events_segment_of(self, name: str) -> tuple[int, int] | None:
        """``(rank, segment)`` of an event-log segment's name in ``events/``, else ``None``."""
        match = _EVENTS_SEGMENT_RE.match(name)
        if match is None:
            return None
        rank, segment = int(match.group(1)), int(match.group(2))
        return (rank, segment) if os.path.basename(self.events_segment(rank, segment)) == name else None

    @property
    def lease(self) -> str:
        return os.path.join(self.root, LEASE)

    @property
    def staging_mark(self) -> str:
        return os.path.join(self.root, STAGING_MARK)

    @property
    def staging_records(self) -> str:
        return os.path.join(self.root, STAGING_RECORDS)

    def relative(self, path: str) -> str:
        """``path`` (inside the cache) relative to its root, with ``/``: the object key under a remote prefix."""
        return os.path.relpath(path, self.root).replace(os.sep, "/")

    def shard_file(self, name: str) -> tuple[int, str] | None:
        """``(shard id, "idx" or "tar")`` of a published shard's file name in ``shards/``, else ``None``."""
        match = _SHARD_FILE_RE.match(name)
        if match is None:
            return None
        shard_id, kind = int(match.group(1)), match.group(2)
        spelled = self.shard_index(shard_id) if kind == "idx" else self.shard_tar(shard_id)
        return (shard_id, kind) if os.path.basename(spelled) == name else None

    def indexed_shard_ids(self) -> list[int]:
        """Shard ids whose index file exists (published, unless damaged afterwards)."""
        try:
            names = os.listdir(self.shards_dir)
        except FileNotFoundError:
            return []
        ids = (_SHARD_INDEX_RE.match(name) for name in names)
        return sorted(int(m.group(1)) for m in ids if m)

    def is_leftover(self, name: str) -> bool:
        """``name`` (in ``shards/``) is one the writer gives a shard or index it has not finished:
        ``shard-N.tar.partial``, or a temporary of ``shard-N.idx`` or of the wids list, spelled as
        the writer spells them (a user's ``notes.tmp`` or ``shard-1.tar.partial`` is not one)."""
        partial = _SHARD_PARTIAL_RE.match(name)
        if partial:
            return os.path.basename(self.shard_partial(int(partial.group(1)))) == name
        base = temporary_base(name)
        if base is None:
            return False
        index = _SHARD_INDEX_RE.match(base)
        if index:
            return os.path.basename(self.shard_index(int(index.group(1)))) == base
        return base == os.path.basename(self.wids_index)

    def partial_files(self) -> list[str]:
        """Leftovers of an interrupted run (named by :meth:`is_leftover`, whatever they are): never read;
        resume deletes them once they are checked to be regular files."""
        try:
            names = os.listdir(self.shards_dir)
        except (FileNotFoundError, NotADirectoryError):
            return []
        return sorted(os.path.join(self.shards_dir, n) for n in names if self.is_leftover(n))

    def ensure_dirs(self) -> None:
        for path in (self.root, self.shards_dir, self.status_dir, self.events_dir):
            os.makedirs(path, exist_ok=True)
