"""A whole ``dspark-regenerate`` run: read the rows, ask the endpoints, write in input order.

The main thread reads the input (the producer's ``InputSource``, so every input form and bad-row rule
of ``dspark-produce`` holds) and hands rows to ``--concurrency`` worker threads, never more than a
window ahead of the oldest row not yet written (what waits in memory stays bounded); each worker
regenerates one row's turns (sequential requests: each turn needs the one before) and hands the
outcome back; the main thread writes outcomes in input order (``writer.OrderedWriter``).
Interrupted (Ctrl-C, SIGTERM), it writes what is complete in order, fsyncs and exits 3: a rerun resumes.

A run none of whose rows gets an answer stops (exit 1) once :data:`ENDPOINT_WIDE_AFTER` rows failed or were
rejected, or at its end when it has fewer: every row refused alike is the endpoint's doing (a wrong URL, a
model it does not serve, a server that fails everything), and exiting 0 or 4 with an empty output would
let ``dspark-regenerate ... && dspark-produce ...`` go on, or record rows as done that were never asked right.
"""

from __future__ import annotations

import base64
import datetime
import decimal
import logging
import queue
import threading
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

import msgspec

from dspark_cache.format.schema import REGENERATED_KEY, RowRegeneration, RowSource
from dspark_cache.producer import InputError, InputSource, InvalidRow, RawRow, counter, normalise_row
from dspark_cache.regenerate.conversation import regenerate, targets
from dspark_cache.regenerate.endpoints import EndpointError, EndpointPool, NoEndpointError, Reply, RowFailed
from dspark_cache.regenerate.output import (
    REJECTED, TRUNCATED, OutputError, OutputFiles, Skipped, answered_before, check_resume, done_rows,
    encode_line, take_lock,
)
from dspark_cache.regenerate.settings import RegenerateConfig, identity, regeneration, row_seed
from dspark_cache.regenerate.writer import Finished, OrderedWriter

log = logging.getLogger(__name__)

_ROW_KEYS = ("messages", "conversations")  # the input's turns, replaced by the regenerated "messages"
# Rows failed or rejected, none answered, after which the endpoint is taken to refuse every row alike:
# more than the requests in flight at the default --concurrency, and far fewer than a dataset.
ENDPOINT_WIDE_AFTER = 16
_COUNT_CHUNK = 1 << 20


class RunError(Exception):
    """The run stopped on a row, an endpoint or the output; the message says what to do next."""


@dataclass
class Result:
    """What a run did: rows written, skipped (invalid or truncated), failed; and what was already done."""

    model: str
    total: int | None
    resumed: int
    written: int = 0
    skipped: int = 0
    failed: list[Skipped] = field(default_factory=list)
    tokens: int = 0
    seconds: float = 0.0


def open_input(cfg: RegenerateConfig) -> InputSource:
    try:
        return InputSource(cfg.input_data, cfg.split, cfg.shuffle_seed, cfg.max_row_bytes)
    except InputError as exc:
        raise RunError(str(exc)) from None


def count_rows(source: InputSource) -> int | None:
    """The rows ``source`` yields, when known without parsing them; JSONL read in order: its non-blank lines
    (every such line is a row, valid or not)."""
    hint = source.count_hint()
    if (
        hint is not None
        or not source.files
        or not all(f.endswith((".jsonl", ".ndjson")) for f in source.files)
    ):
        return hint
    return sum(_non_blank_lines(file) for file in source.files)


def _non_blank_lines(path: str) -> int:
    """The lines of ``path`` holding more than whitespace, read in chunks: a line of hundreds of megabytes
    (one the run skips as over --max-row-bytes) is counted, never held whole."""
    total, text = 0, False  # text: the line in progress holds more than whitespace
    with open(path, "rb") as handle:
        while chunk := handle.read(_COUNT_CHUNK):
            *ended, tail = chunk.split(b"\n")
            for line in ended:
                total += text or bool(line.strip())
                text = False
            text = text or bool(tail.strip())
    return total + text


def connect(cfg: RegenerateConfig) -> EndpointPool:
    """The endpoints, probed: raises :class:`RunError` when none answers or they disagree on the model."""
    try:
        pool = EndpointPool(cfg.endpoint, cfg.key, cfg.request_timeout, cfg.retries, cfg.give_up_after)
        pool.probe(cfg.model)
    except (NoEndpointError, EndpointError) as exc:
        raise RunError(str(exc)) from None
    return pool


def _json_value(value: Any) -> Any:
    """What JSON holds for a value of an input column that JSON has no type for (Parquet and datasets
    give timestamps, decimals and binary columns): ISO 8601 text, seconds, digits, base64 text, lists."""
    if isinstance(value, (datetime.datetime, datetime.date, datetime.time)):
        return value.isoformat()
    if isinstance(value, datetime.timedelta):
        return value.total_seconds()
    if isinstance(value, decimal.Decimal):
        return format(value, "f")  # digits, never 1E+2
    if isinstance(value, uuid.UUID):
        return str(value)
    if getattr(getattr(value, "dtype", None), "kind", None) in ("M", "m"):  # numpy datetime64 / timedelta64
        return value.astype(str).tolist()  # ISO 8601 text, not a count of nanoseconds
    if isinstance(value, (bytes, bytearray, memoryview)):
        return base64.b64encode(bytes(value)).decode("ascii")
    if isinstance(value, (set, frozenset)):
        return sorted(value, key=repr)
    if hasattr(value, "tolist") and callable(value.tolist):  # numpy scalars and arrays
        return value.tolist()
    raise TypeError(f"a value of type {type(value).__name__}, which JSON cannot hold")


def encode_row(out: dict[str, Any]) -> bytes:
    """One output line (``output.encode_line``, input columns' types as :func:`_json_value` writes them)."""
    return encode_line(out, _json_value)


def _kept(value: dict[str, Any]) -> dict[str, Any]:
    """The input row's other columns, written as they are: everything but its turns and an older record."""
    return {k: v for k, v in value.items() if k not in (*_ROW_KEYS, REGENERATED_KEY)}


def check_row(value: dict[str, Any], messages: list[dict[str, Any]], tools: Any, turns: str) -> None:
    """Raise :class:`InvalidRow` for a row no server can answer or whose output line cannot be written, before
    any request is sent for it: the same bad-row policy as every other invalid row."""
    if not messages:
        raise InvalidRow("empty conversation", "'messages' is empty: there is nothing to answer")
    first = targets(messages, turns)[0]
    if all(m["role"] == "system" for m in messages[:first]):
        raise InvalidRow(
            "nothing to answer",
            f"no user or tool turn comes before turn {first}, the first one to "
            f"regenerate (--turns {turns}): there is nothing to answer",
        )
    for name, part in (("messages", messages), ("tools", tools), *_kept(value).items()):
        try:
            encode_row({name: part})
        except UnicodeEncodeError:
            raise InvalidRow(
                "lone surrogate",
                f"{_where(name)} holds a lone UTF-16 surrogate, which is not valid Unicode text",
            ) from None
        except (TypeError, ValueError) as exc:
            raise InvalidRow("value not JSON", f"{_where(name)} holds {exc}") from None
        except RecursionError:
            raise InvalidRow("nested too deep", f"{_where(name)} is nested deeper than JSON text can be "
                             "written here") from None


def _where(name: str) -> str:
    return f"'{name}'" if name in ("messages", "tools") else f"column {name!r}"


class _Job:
    """One row handed to a worker."""

    def __init__(self, seq: int, row: RawRow, messages: list[dict[str, Any]], tools: Any) -> None:
        self.seq, self.row, self.messages, self.tools = seq, row, messages, tools


class Regenerator:
    """The run's parts, so that the worker threads and the main loop share them."""

    def __init__(self, cfg: RegenerateConfig, pool: EndpointPool) -> None:
        self.cfg = cfg
        self.pool = pool
        self.settings = regeneration(cfg, pool.model)
        self.sampling: dict[str, Any] = {"temperature": cfg.temperature, "top_p": cfg.top_p,
                                         "max_tokens": cfg.max_tokens}
        if cfg.template_kwargs:
            self.sampling["chat_template_kwargs"] = cfg.template_kwargs
        self.jobs: queue.Queue[_Job | None] = queue.Queue()
        self.results: queue.Queue[tuple[int, Finished | BaseException]] = queue.Queue()

    def row_outcome(self, job: _Job) -> Finished:
        """Regenerate one row: its output line, or why it is skipped or failed (raises a run-stopping error)."""
        row, seed = job.row, row_seed(self.cfg.seed, job.row.index)

        def generate(history: list[dict[str, Any]]) -> Reply:
            body = {"messages": history, "seed": seed, **self.sampling}
            if job.tools:
                body["tools"] = job.tools
            return self.pool.chat(body)

        try:
            messages, replies = regenerate(job.messages, self.cfg.turns, generate)
        except RowFailed as exc:
            # the server's answer will not change: not asked again
            if exc.final and self.cfg.on_failed == "skip":
                return Finished(skipped=Skipped(index=row.index, where=row.where, reason=REJECTED,
                                                detail=exc.reason))
            return Finished(failed=Skipped(index=row.index, where=row.where, reason="request failed",
                                           detail=exc.reason))
        tokens = sum(r.completion_tokens for r in replies)
        reasons = [r.finish_reason for r in replies]
        if self.cfg.on_truncated == "drop" and "length" in reasons:
            cut = Skipped(index=row.index, where=row.where, reason=TRUNCATED,
                          detail=f"a turn reached --max-tokens {self.cfg.max_tokens}")
            return Finished(skipped=cut, tokens=tokens, answered=True)
        record = RowRegeneration(
            **msgspec.structs.asdict(self.settings),
            row_seed=seed,
            finish_reasons=reasons,
            completion_tokens=tokens,
            source=RowSource(index=row.index, where=row.where),
        )
        out = {"messages": messages, **_kept(row.value), REGENERATED_KEY: msgspec.to_builtins(record)}
        # check_row and parse_reply vouch for every value
        return Finished(row=encode_row(out), tokens=tokens, answered=True)

    def work(self) -> None:
        """A worker thread: jobs until ``None``."""
        while (job := self.jobs.get()) is not None:
            if self.pool.stopped:  # the run is stopping: the rows handed out but not begun are not asked
                continue
            try:
                self.results.put((job.seq, self.row_outcome(job)))
            except BaseException as exc:  # noqa: BLE001 - handed to the main thread, which stops the run
                self.results.put((job.seq, exc))


def _invalid(row: RawRow, error: InvalidRow) -> Skipped:
    return Skipped(index=row.index, where=row.where, reason=error.reason, detail=error.detail)


def run_regenerate(cfg: RegenerateConfig, progress_total: bool = True) -> Result:
    """The run (see the module's docstring); raises :class:`RunError` with the message for the user."""
    source = open_input(cfg)
    pool = connect(cfg)  # before anything is written: no endpoint, no files
    files = OutputFiles.of(cfg.output)
    try:
        lock = take_lock(files)
    except OSError as exc:
        raise RunError(
            f"--output {cfg.output} cannot be written ({exc.strerror or exc}); choose a writable path"
        ) from None
    try:
        try:
            sha = source.content_sha256()
            resumed = check_resume(files, identity(cfg, sha, pool.model), cfg.overwrite)
            done = done_rows(files) if resumed else set()
        except InputError as exc:
            raise RunError(str(exc)) from None
        total = count_rows(source) if progress_total else None
        if done:
            log.info("resuming %s: %d rows already done", cfg.output, len(done))
        result = Result(pool.model, total, len(done))
        _loop(cfg, Regenerator(cfg, pool), source, files, done, result, answered_before(files))
        return result
    finally:
        if lock is not None:
            lock.release()


def endpoint_wide(unanswered: list[Skipped], files: OutputFiles) -> RunError:
    """The run's stop when no row got an answer: the endpoint and the cause (the server's words on the last
    row), and what to do; the rows are listed in OUTPUT.failed, none recorded as done."""
    last = unanswered[-1]
    # the rule's count, not len(unanswered): rows finishing out of order can pass it by a few at once
    some = ("every row sent" if len(unanswered) < ENDPOINT_WIDE_AFTER
            else f"the first {ENDPOINT_WIDE_AFTER} rows sent")
    return RunError(f"{some} failed or was rejected and none got an answer, so the endpoint refuses every "
                    f"row alike (the last, {last.where}: {last.detail}). Nothing was recorded as done (the "
                    f"rows are listed in {files.failed}): fix the server or --endpoint/--model, then rerun "
                    "the same command")


def _loop(cfg: RegenerateConfig, regen: Regenerator, source: InputSource, files: OutputFiles, done: set[int],
          result: Result, answered: bool = True) -> None:
    writer = OrderedWriter(files, cfg.fsync_rows, proven=answered)
    threads = [
        threading.Thread(target=regen.work, daemon=True, name=f"regenerate-{i}")
        for i in range(cfg.concurrency)
    ]
    for thread in threads:
        thread.start()
    # Rows handed out ahead of the oldest unwritten one: room for a slow row (a long conversation) not to
    # idle the other workers, while what waits for it in memory stays bounded.
    window = max(64, 8 * cfg.concurrency)
    started = time.monotonic()
    seq = 0
    todo = None if result.total is None else max(result.total - len(done), 0)
    stop: BaseException | None = None

    with counter("regenerating", "rows", total=todo) as bar:
        def hand(got_seq: int, outcome: Finished) -> None:
            """Give the writer one outcome; count what it writes now; a failed row under --on-failed error stops."""
            nonlocal stop
            for written in writer.put(got_seq, outcome):
                result.tokens += written.tokens
                bar.update()
                bar.note(f"{result.tokens / max(time.monotonic() - started, 1e-9):.0f} generated tok/s")
                if not writer.proven and len(writer.unanswered) >= ENDPOINT_WIDE_AFTER and stop is None:
                    stop = endpoint_wide(writer.unanswered, files)
                    regen.pool.stop()
                if written.failed is None:
                    continue
                log.warning("%s: %s", written.failed.where, written.failed.detail)
                if cfg.on_failed == "error" and stop is None:
                    stop = RunError(
                        f"{written.failed.where}: the request failed: {written.failed.detail}. Check the "
                        "server's log; rerun the same command to resume (or pass --on-failed skip to "
                        "list such rows and go on)"
                    )
                    regen.pool.stop()

        def settle(block: bool) -> None:
            """Take the finished outcomes (waiting a moment for one when ``block``); stop on a run-stopping error."""
            nonlocal stop
            while True:
                try:
                    got_seq, outcome = regen.results.get(timeout=0.2 if block else 0)
                except queue.Empty:
                    return
                if isinstance(outcome, BaseException):
                    stop = stop or outcome
                    regen.pool.stop()
                    return
                hand(got_seq, outcome)
                block = False

        try:
            for row in source.rows():
                if stop is not None:
                    break
                if row.index in done:
                    continue
                messages, tools, error = None, None, row.error
                if error is None:
                    try:
                        messages, tools = normalise_row(row.value)
                        check_row(row.value, messages, tools, cfg.turns)
                    except InvalidRow as exc:
                        error = exc
                if error is not None:
                    if cfg.on_invalid == "error":
                        while writer.next_seq < seq and stop is None:  # rows before it are written first
                            settle(True)
                        stop = stop or RunError(
                            f"{row.where}: invalid row ({error.reason}): {error.detail}. Fix the "
                            "row, or pass --on-invalid skip to skip such rows (listed in "
                            f"{files.skipped}); rerun the same command to resume"
                        )
                        break
                    hand(seq, Finished(skipped=_invalid(row, error)))
                else:
                    regen.jobs.put(_Job(seq, row, messages, tools))
                seq += 1
                while seq - writer.next_seq >= window and stop is None:
                    settle(True)
                settle(False)
            while writer.next_seq < seq and stop is None:
                settle(True)
            if stop is None and not writer.proven and writer.unanswered:
                stop = endpoint_wide(writer.unanswered, files)
        except InputError as exc:
            stop = stop or RunError(str(exc))
        except BaseException as exc:  # Ctrl-C, SIGTERM, a full disk: what is done in order is kept
            stop = stop or exc
            regen.pool.stop()
        finally:
            for _ in threads:
                regen.jobs.put(None)
            try:
                writer.close()
            except OutputError as exc:
                stop = stop or exc
            result.written, result.skipped, result.failed = writer.written, writer.skipped, writer.failed
            result.seconds = time.monotonic() - started
    if stop is not None:
        if isinstance(stop, (NoEndpointError, EndpointError)):
            raise RunError(f"{stop}") from None
        raise stop
