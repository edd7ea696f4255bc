"""What every dspark console script shares: the exit codes, the parser's conventions, logging.

Each part defines its own options next to its code; this module is the one place for the rest,
so ``dspark-produce``, ``dspark-monitor``, ``dspark-verify`` and ``dspark-convert`` behave alike:
``--version`` and ``--log-level`` on every script, a usage error is one line on stderr and exit
code 2, ``--help`` exits 0, and every exit code means what :data:`EXIT_CODES` says (the README's
table). It imports nothing heavy: a usage error or ``--help`` costs no torch.
"""

from __future__ import annotations

import argparse
import atexit
import logging
import os
import shlex
import shutil
import signal
import sys
import threading
from typing import TYPE_CHECKING, Callable, NoReturn

from dspark_cache import __version__

if TYPE_CHECKING:
    from dspark_cache.storage.backing import StorageOptions

EXIT_OK = 0
EXIT_ERROR = 1
EXIT_USAGE = 2
EXIT_STOPPED = 3
EXIT_INCOMPLETE = 4
EXIT_NOT_A_CACHE = EXIT_USAGE  # dspark-verify: nothing there to check, like a wrong argument

EXIT_CODES: dict[int, str] = {
    EXIT_OK: "done (or nothing to do; dspark-verify: every byte checks out)",
    EXIT_ERROR: "failed, or problems found: the message names the file and says what to do next",
    EXIT_USAGE: "usage error (one line on stderr), or a path that is not the cache the command needs",
    EXIT_STOPPED: "stopped on request or interrupted: rerun the same command to resume",
    EXIT_INCOMPLETE: "finished, but part of the work is missing (dspark-produce: shards of a rank that died, "
    "rerun with any number of ranks; dspark-regenerate: rows whose requests failed): rerun the same "
    "command to complete it",
}

LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "WARN", "ERROR", "CRITICAL")  # WARN: logging's alias of WARNING
LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


def reader_failure_code(exc: BaseException) -> int:
    """The exit code of a reader (dspark-verify, dspark-monitor) that could not open what it was given: a
    store that failed or refused it is a failure (1, as dspark-produce says it); what is not there is a
    path that is not a cache (2: a bucket that does not exist, a directory that holds no cache)."""
    from dspark_cache.storage.remote.store import NoSuchBucketError, ObjectStoreError

    if isinstance(exc, ObjectStoreError) and not isinstance(exc, NoSuchBucketError):
        return EXIT_ERROR
    return EXIT_NOT_A_CACHE


class UsageError(Exception):
    """Arguments that parse but do not make sense together: one line on stderr, exit 2."""


class UsageParser(argparse.ArgumentParser):
    """``argparse`` with usage errors as one line (exit 2), not argparse's usage block."""

    def error(self, message: str) -> NoReturn:
        print(f"{self.prog}: error: {message} (see {self.prog} --help)", file=sys.stderr)
        raise SystemExit(EXIT_USAGE)


class DefaultsHelpFormatter(argparse.HelpFormatter):
    """``--help`` with each option's default, unless its help already says it or there is none to show."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help or ""
        default = action.default
        if ("default" in text.lower() or default is None or default is False or default == argparse.SUPPRESS
                or not action.option_strings):
            return action.help
        shown = " ".join(map(str, default)) if isinstance(default, (list, tuple)) else "%(default)s"
        return f"{text} (default: {shown})" if text else f"default: {shown}"


class RawDescriptionDefaultsHelpFormatter(argparse.RawDescriptionHelpFormatter, DefaultsHelpFormatter):
    """:class:`DefaultsHelpFormatter` that keeps the description's own line breaks."""


def exit_codes_epilog(*codes: int) -> str:
    """``--help``'s exit-status paragraph for a script that uses ``codes`` (from the one table)."""
    return "exit status: " + "; ".join(f"{code} {EXIT_CODES[code]}" for code in codes)


def new_parser(prog: str, description: str, *, log_level: str = "WARNING", epilog: str | None = None,
               raw_description: bool = False) -> UsageParser:
    """A script's parser with the shared options: ``--version`` and ``--log-level``."""
    formatter = RawDescriptionDefaultsHelpFormatter if raw_description else DefaultsHelpFormatter
    parser = UsageParser(prog=prog, description=description, epilog=epilog, formatter_class=formatter)
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    parser.add_argument("--log-level", type=str.upper, choices=LOG_LEVELS, default=log_level,
                        metavar="LEVEL", help=f"{', '.join(LOG_LEVELS)} (default {log_level})")
    return parser


def not_an_entry(prog: str, module: str, entry: str) -> NoReturn:
    """A part's ``cli`` module run as ``python -m`` would run nothing and exit 0, which a job script
    naming that module reads as done: say which module to run instead, and exit 2."""
    print(f"{prog}: error: python -m {module} is not an entry point; run python -m {entry} with the same "
          "arguments", file=sys.stderr)
    sys.exit(EXIT_USAGE)


def usage_error(prog: str, message: str) -> int:
    """Report a usage error found after parsing; returns :data:`EXIT_USAGE`."""
    print(f"{prog}: error: {message} (see {prog} --help)", file=sys.stderr)
    return EXIT_USAGE


def error(prog: str, message: str, code: int = EXIT_ERROR) -> int:
    """Report a failure (one message that says what to do next); returns ``code``."""
    print(f"{prog}: error: {message}", file=sys.stderr)
    return code


def add_storage_arguments(
    parser: argparse.ArgumentParser,
    *,
    local_cache: bool = True,
    cache_limit: bool = True,
    staging: bool = False,
    local_cache_help: str | None = None,
) -> None:
    """The options of a cache at an object-store URL (``s3://bucket/prefix``), the same on every script:
    ``local_cache`` where something of it is kept on this node (``cache_limit``: its tars, bounded),
    ``staging`` where it is written."""
    group = parser.add_argument_group("caches on object storage (s3://, gs://, az://; pip install "
                                      "\"dspark-cache[s3]\")")
    group.add_argument("--storage-options", metavar="JSON", default=None,
                       help="the object-store client's options as a JSON object (endpoint, region, "
                       "credentials, client_options, retry_config); default: $DSPARK_STORAGE_OPTIONS, "
                       "then the AWS_* variables. Values are never printed")
    if local_cache:
        group.add_argument("--local-cache-dir", metavar="DIR", default=None,
                           help=local_cache_help or "where this node keeps downloaded shards (default "
                           "$DSPARK_LOCAL_CACHE_DIR or ~/.cache/dspark-cache/remote)")
    if local_cache and cache_limit:
        group.add_argument(
            "--cache-limit",
            metavar="SIZE",
            default=None,
            help="bytes of shards kept there, e.g. 200G (default $DSPARK_CACHE_LIMIT or half the free space)",
        )
    if staging:
        group.add_argument(
            "--staging-dir",
            metavar="DIR",
            default=None,
            help="local directory shards are written to before their upload (default "
            "$DSPARK_LOCAL_CACHE_DIR/staging/... or ~/.cache/dspark-cache/remote/staging/...); one per "
            "cache, shared by the processes of a node",
        )
        group.add_argument(
            "--staging-limit",
            metavar="SIZE",
            default=None,
            help="bytes of finished shards waiting there for their upload before writing waits, per "
            "process, e.g. 16G (default 8G; one shard always fits)",
        )


def storage_from_args(args: argparse.Namespace) -> "StorageOptions":
    """The :class:`StorageOptions` of :func:`add_storage_arguments`; a malformed value is a usage error."""
    from dspark_cache.storage.backing import StorageOptions, parse_size, parse_storage_options

    try:
        options = None if args.storage_options is None else parse_storage_options(args.storage_options,
                                                                                    "--storage-options")
        limit = getattr(args, "cache_limit", None)
        return StorageOptions(options, getattr(args, "local_cache_dir", None),
                              None if limit is None else parse_size(limit, "--cache-limit"))
    except ValueError as exc:
        raise UsageError(str(exc)) from None


def staging_limit_from_args(args: argparse.Namespace) -> int | None:
    """``--staging-limit`` in bytes (``None``: the default); a malformed size is a usage error."""
    from dspark_cache.storage.backing import parse_size

    try:
        return None if args.staging_limit is None else parse_size(args.staging_limit, "--staging-limit")
    except ValueError as exc:
        raise UsageError(str(exc)) from None


# The module each console script runs, for a hint when the script itself is not installed anywhere.
SCRIPT_MODULES = {
    "dspark-produce": "dspark_cache.producer",
    "dspark-monitor": "dspark_cache.tui",
    "dspark-verify": "dspark_cache.verify",
    "dspark-convert": "dspark_cache.nemo.convert",
    "dspark-regenerate": "dspark_cache.regenerate",
}


def command_hint(script: str) -> str:
    """How the user can run ``script`` from here, for a hint printed to them.

    The bare name when the one on PATH is this installation's (or the only one there is), else
    the script beside this Python (a venv not activated: ``.venv/bin/dspark-monitor``), else the
    module through this Python (``pip install --target`` and similar leave no script at all).
    """
    beside = os.path.join(os.path.dirname(sys.executable), script)
    beside = beside if os.path.isfile(beside) and os.access(beside, os.X_OK) else None
    on_path = shutil.which(script)
    if on_path and (beside is None or os.path.samefile(on_path, beside)):
        return script
    if beside is not None:
        relative = os.path.relpath(beside)
        # Relative only when it stays inside the working directory (``.venv/bin/...``), like the README's.
        return shlex.quote(relative if not relative.startswith(os.pardir) else beside)
    return f"{shlex.quote(sys.executable)} -m {SCRIPT_MODULES[script]}"


def run_script(parser: UsageParser, run: Callable[[argparse.Namespace], int], argv: list[str] | None) -> int:
    """Parse ``argv`` (``sys.argv[1:]`` when None), set up logging, call the part's ``run``.

    ``--help``, ``--version`` and usage errors raise ``SystemExit`` (0, 0, 2) as argparse does;
    a :class:`UsageError` from ``run`` exits 2 with one line, an interrupt exits 3.
    """
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    logging.basicConfig(level=args.log_level, format=LOG_FORMAT)
    exiting = _ExitOnSignals(parser.prog) if argv is None else None  # this process's own command line
    code = EXIT_STOPPED
    try:
        code = run(args)
    except UsageError as exc:
        code = usage_error(parser.prog, str(exc))
    except KeyboardInterrupt:
        print(f"{parser.prog}: interrupted; rerun the same command to resume", file=sys.stderr)
    finally:
        if exiting is not None:
            exiting.code = code
    return code


class _ExitOnSignals:
    """SIGINT/SIGTERM for a process that runs one command and exits: KeyboardInterrupt while it runs (the
    producer's stop flag takes over while it computes, and gives this back), then, once the exit code is
    known, one line and that code at once.

    Left to Python, a signal during the exit (the second Ctrl-C of two) raises KeyboardInterrupt inside
    the interpreter's shutdown (a traceback from an atexit callback or a thread join) or, once the
    interpreter has reset its handlers, kills the process (exit -2, not ours). From the last atexit
    callback on the signals are ignored instead: the interpreter leaves an ignored signal ignored.
    """

    def __init__(self, prog: str) -> None:
        self.prog = prog
        self.code: int | None = None
        if threading.current_thread() is not threading.main_thread():
            return
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, self._on_signal)
        atexit.register(self._ignore)  # registered before the command runs: called after its callbacks

    def _on_signal(self, signum: int, _frame: object) -> None:
        if self.code is None:
            raise KeyboardInterrupt
        name = signal.Signals(signum).name
        line = f"{self.prog}: {name} while exiting: exiting now; rerun the same command to resume\n"
        os.write(2, line.encode())  # not print: the signal may have interrupted a write to sys.stderr
        os._exit(self.code)

    @staticmethod
    def _ignore() -> None:
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, signal.SIG_IGN)
