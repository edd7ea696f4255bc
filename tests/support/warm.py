"""The console scripts' processes forked from a warm interpreter instead of started cold.

A producer, rank or monitor a test starts spends about 3.5 s of CPU importing torch and
transformers before it does anything, and the suite starts well over a hundred of them on two
cores. The warm interpreter (one per test process, started at its first use) imports them once;
each start forks it. The fork is a real process: its own pid and session, the pipes or files the
test gave it, the test's environment and working directory, the same console-script function
(or ``python -m`` module) the installed script runs, its exit status the kernel's (a signal's
death included), its threads joined and its ``atexit`` run by the interpreter as at any exit.

What a fork cannot give is what a module reads from the environment when it is imported
(huggingface_hub's cache and offline settings, for one), nor a ``/proc/PID/environ`` that shows
the test's environment (only ``exec`` writes that, and the orphan tests find processes by it). So
a start is forked from the interpreter that has imported nothing its environment changes: the
full one when it differs from the session's only in keys read when called
(:data:`CALL_TIME_KEYS`), one with torch alone when it also changes the hub's settings
(:data:`HUB_PREFIXES`); any other start runs the installed script cold. A test about the installed
script itself starts it with :mod:`subprocess`.
"""

from __future__ import annotations

import atexit
import functools
import io
import json
import os
import select
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from typing import Any

BIN = os.path.dirname(sys.executable)
PACKAGE = "dspark_cache"
# ``python -m`` modules started warm: ours, and the suite's workers (which import them).
WARM_MODULES = (PACKAGE + ".", "tests.support.")
# The session's environment, before any test changed it: the warm interpreter imports under it.
BASE_ENV = dict(os.environ)

# Read by our code (faults, the loader's filler switch) and by torch.distributed when called.
CALL_TIME_PREFIXES = ("DSPARK_",)
# PYTHONUNBUFFERED is read at start-up, and a child's streams are made as start-up makes them.
# TORCHINDUCTOR_CACHE_DIR is set by torch itself, in the test process, the first time it asks.
CALL_TIME_KEYS = frozenset(
    {
        "PYTHONUNBUFFERED",
        "PYTEST_CURRENT_TEST",
        "RANK",
        "LOCAL_RANK",
        "WORLD_SIZE",
        "LOCAL_WORLD_SIZE",
        "GROUP_RANK",
        "MASTER_ADDR",
        "MASTER_PORT",
        "TORCHINDUCTOR_CACHE_DIR",
    }
)

# Read when imported by huggingface_hub, transformers and datasets, and by nothing torch imports.
HUB_PREFIXES = ("HF_", "HUGGINGFACE_", "TRANSFORMERS_", "DATASETS_")


@dataclass(frozen=True)
class Kind:
    """A warm interpreter: what it imports, and the keys a start may change beyond the call-time ones."""

    name: str
    preload: tuple[str, ...]
    also_free: tuple[str, ...] = ()

    def accepts(self, env: dict[str, str]) -> bool:
        """Whether a start with ``env`` sees nothing the preloaded modules read under another one."""
        # The orphan tests find processes by this marker in /proc/PID/environ: only exec writes it.
        # (Imported here: the warm interpreter runs this file as a script, without the tests package.)
        from tests.support.processes import MARKER

        for key in set(env) | set(BASE_ENV):
            if env.get(key) == BASE_ENV.get(key):
                continue
            if key == MARKER:
                return False
            if not (key in CALL_TIME_KEYS or key.startswith(CALL_TIME_PREFIXES + self.also_free)):
                return False
        return True


KINDS = (
    Kind(
        "full",
        (
            "torch",
            "transformers",
            "transformers.models.qwen3.modeling_qwen3",
            "transformers.models.qwen3_moe.modeling_qwen3_moe",
            "dspark_cache.cli",
            "dspark_cache.producer.run",
            "dspark_cache.producer.pipeline",
            "dspark_cache.loader",
            "dspark_cache.verify.checks",
        ),
    ),
    Kind("torch", ("torch", "numpy", "msgspec"), HUB_PREFIXES),
)


@functools.cache
def _scripts() -> dict[str, str]:
    """Our console scripts' names and ``module:function`` targets, as installed."""
    from importlib.metadata import entry_points

    return {
        ep.name: ep.value
        for ep in entry_points(group="console_scripts")
        if ep.value.startswith(PACKAGE + ".")
    }


# -- the warm interpreter ---------------------------------------------------------------------------

def _serve(path: str, preload: list[str]) -> Any:
    """Import ``preload``, then accept starts on the socket at ``path`` until our parent is gone; in a
    forked child, return what the child runs (run by :func:`_run_child` at the top level)."""
    import importlib

    for name in preload:
        importlib.import_module(name)
    parent = os.getppid()
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(64)
    waiting: dict[int, socket.socket] = {}  # child pid -> the connection its status goes back on
    sys.stdout.write("ready\n")
    sys.stdout.flush()
    while os.getppid() == parent:
        if select.select([listener], [], [], 0.02)[0]:
            conn, _ = listener.accept()
            msg, fds, _, _ = socket.recv_fds(conn, 1 << 20, 3)
            request = json.loads(msg)
            sys.stdout.flush()
            sys.stderr.flush()
            pid = os.fork()
            if pid == 0:
                listener.close()
                for other in (*waiting.values(), conn):
                    other.close()
                return _child(request, fds)
            for fd in fds:
                os.close(fd)
            conn.sendall(json.dumps({"pid": pid}).encode() + b"\n")
            waiting[pid] = conn
        while waiting:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                break
            if pid == 0:
                break
            conn = waiting.pop(pid, None)
            if conn is not None:
                try:
                    conn.sendall(json.dumps({"status": status}).encode() + b"\n")
                except OSError:  # the test is gone
                    pass
                conn.close()
    for pid in waiting:  # the test process is gone: leave nothing of its behind
        try:
            os.killpg(pid, signal.SIGKILL)
        except OSError:
            pass
    return None


def _child(request: dict, fds: list[int]) -> Any:
    """Become the started process: session, standard streams, directory, environment, argv."""
    # The handlers a fresh interpreter starts with.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    signal.signal(signal.SIGPIPE, signal.SIG_IGN)
    if request["new_session"]:
        os.setsid()
    for target, fd in enumerate(fds):
        os.dup2(fd, target)
        os.close(fd)
    # Streams made as interpreter start-up makes them: a terminal's stdout is line-buffered.
    unbuffered = bool(request["env"].get("PYTHONUNBUFFERED"))
    encoding = sys.stdout.encoding
    sys.stdin = sys.__stdin__ = io.open(0, "r", encoding=encoding, closefd=False)
    sys.stdout = sys.__stdout__ = io.TextIOWrapper(
        io.open(1, "wb", buffering=0 if unbuffered else -1, closefd=False),
        encoding,
        line_buffering=os.isatty(1),
        write_through=unbuffered,
    )
    sys.stderr = sys.__stderr__ = io.TextIOWrapper(
        io.open(2, "wb", buffering=0 if unbuffered else -1, closefd=False),
        encoding,
        "backslashreplace",
        line_buffering=True,
        write_through=unbuffered,
    )
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    argv: list[str] = request["argv"]
    if argv[0] == "-c":
        import types

        main = types.ModuleType("__main__")
        sys.modules["__main__"] = main
        sys.argv = ["-c", *argv[2:]]
        sys.path.insert(0, "")
        return lambda: exec(compile(argv[1], "<string>", "exec"), main.__dict__)
    if argv[0] == "-m":
        import runpy

        sys.argv = [argv[1], *argv[2:]]
        sys.path.insert(0, os.getcwd())
        return lambda: runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
    module, _, function = _scripts()[os.path.basename(argv[0])].partition(":")
    sys.argv = list(argv)
    sys.path.insert(0, BIN)
    import importlib

    entry = getattr(importlib.import_module(module), function)
    return lambda: sys.exit(entry())


def _exit_code(code: object) -> int:
    """The status the interpreter exits with for ``SystemExit(code)``."""
    if code is None:
        return 0
    if isinstance(code, int):
        return code & 0xFF
    print(code, file=sys.stderr)
    return 1


def _run_child(run: Any) -> None:
    """Run the child's entry and exit as the interpreter does (its non-daemon threads joined, then
    ``atexit``, then the streams flushed), but without tearing down the preloaded modules, which
    costs a second and changes nothing a test can see."""
    interrupted = False
    try:
        run()
        code = 0
    except SystemExit as exc:
        code = _exit_code(exc.code)
    except KeyboardInterrupt:
        sys.excepthook(*sys.exc_info())
        code, interrupted = 1, True
    except BaseException:
        sys.excepthook(*sys.exc_info())
        code = 1
    threading._shutdown()  # type: ignore[attr-defined]
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    if interrupted:  # an unhandled Ctrl-C ends the process by SIGINT, as the interpreter ends it
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGINT)
    os._exit(code)


# -- the test's side --------------------------------------------------------------------------------

class _Interpreter:
    """One of this test process's warm interpreters, started at its kind's first start."""

    def __init__(self, kind: Kind) -> None:
        self.dir = tempfile.mkdtemp(prefix=f"dspark-warm-{kind.name}-")
        self.path = os.path.join(self.dir, "sock")
        self.proc = subprocess.Popen(
            [sys.executable, os.path.abspath(__file__), "--serve", self.path, *kind.preload],
            env=BASE_ENV,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            text=True,
        )
        if self.proc.stdout.readline().strip() != "ready":
            raise RuntimeError(f"the warm interpreter did not start (exit {self.proc.wait()})")
        atexit.register(self.close)

    def close(self) -> None:
        self.proc.kill()
        self.proc.wait()
        for name in os.listdir(self.dir):
            os.unlink(os.path.join(self.dir, name))
        os.rmdir(self.dir)


_interpreters: dict[str, _Interpreter] = {}
_interpreters_lock = threading.Lock()


def _interpreter(kind: Kind) -> _Interpreter:
    with _interpreters_lock:
        if kind.name not in _interpreters:
            _interpreters[kind.name] = _Interpreter(kind)
        return _interpreters[kind.name]


def _warm_argv(cmd: list[str], code: bool) -> list[str] | None:
    """The forked child's argv for ``cmd``, or None when ``cmd`` is not one of our entries (nor, when
    ``code``, ``python -c``)."""
    if len(cmd) >= 3 and cmd[0] == sys.executable and cmd[1] == "-m" and cmd[2].startswith(WARM_MODULES):
        return ["-m", *cmd[2:]]
    if code and len(cmd) >= 3 and cmd[0] == sys.executable and cmd[1] == "-c":
        return cmd[1:]
    if os.path.dirname(cmd[0]) == BIN and os.path.basename(cmd[0]) in _scripts():
        return list(cmd)
    return None


class WarmProcess:
    """A started process as :class:`subprocess.Popen` shows one: ``pid``, ``stdout``/``stderr``
    pipes, ``poll``/``wait``/``communicate``, ``send_signal``/``kill``, ``returncode``
    (minus the signal for a process a signal ended)."""

    def __init__(
        self,
        interpreter: _Interpreter,
        args: list[str],
        argv: list[str],
        env: dict[str, str],
        *,
        stdin: Any,
        stdout: Any,
        stderr: Any,
        text: bool,
        new_session: bool,
        cwd: str | None,
    ) -> None:
        self.args = args
        self.returncode: int | None = None
        self._text = text
        self._chunks: dict[int, list[bytes]] = {}
        ends: list[int] = []
        to_close: list[int] = []
        self.stdout = self.stderr = None
        for target, spec in enumerate((stdin, stdout, stderr)):
            if spec is None:
                ends.append(target)
            elif spec == subprocess.DEVNULL:
                fd = os.open(os.devnull, os.O_RDWR)
                ends.append(fd)
                to_close.append(fd)
            elif spec == subprocess.STDOUT:
                ends.append(ends[1])
            elif spec == subprocess.PIPE:
                if target == 0:
                    raise ValueError("a warm start takes no stdin pipe")
                read, write = os.pipe()
                ends.append(write)
                to_close.append(write)
                handle = open(read, "r" if text else "rb", closefd=True)
                setattr(self, ("stdout", "stderr")[target - 1], handle)
                self._chunks[read] = []
            else:
                ends.append(spec if isinstance(spec, int) else spec.fileno())
        self._conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._conn.connect(interpreter.path)
        request = {"argv": argv, "env": env, "cwd": cwd or os.getcwd(), "new_session": new_session}
        socket.send_fds(self._conn, [json.dumps(request).encode()], ends)
        for fd in to_close:
            os.close(fd)
        self._buffer = b""
        self.pid: int = self._message(None)["pid"]

    def _message(self, timeout: float | None) -> dict | None:
        while b"\n" not in self._buffer:
            if not select.select([self._conn], [], [], timeout)[0]:
                return None
            data = self._conn.recv(4096)
            if not data:
                raise RuntimeError(f"the warm interpreter went away while running {self.args}")
            self._buffer += data
        line, self._buffer = self._buffer.split(b"\n", 1)
        return json.loads(line)

    def poll(self) -> int | None:
        return self.wait(timeout=0, _raise=False)

    def wait(self, timeout: float | None = None, _raise: bool = True) -> int | None:
        if self.returncode is None:
            done = self._message(timeout)
            if done is None:
                if _raise:
                    raise subprocess.TimeoutExpired(self.args, timeout)
                return None
            self.returncode = os.waitstatus_to_exitcode(done["status"])
            self._conn.close()
        return self.returncode

    def communicate(self, input: Any = None, timeout: float | None = None) -> tuple[Any, Any]:
        if input is not None:
            raise ValueError("a warm start takes no input")
        deadline = None if timeout is None else time.monotonic() + timeout
        streams = {h.fileno(): h for h in (self.stdout, self.stderr) if h is not None and not h.closed}
        while streams:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            ready = select.select(list(streams), [], [], left)[0]
            if not ready:
                raise subprocess.TimeoutExpired(self.args, timeout)
            for fd in ready:
                data = os.read(fd, 1 << 16)
                if data:
                    self._chunks[fd].append(data)
                else:
                    streams.pop(fd)
        self.wait(None if deadline is None else max(0.0, deadline - time.monotonic()))
        out = [self._collected(h) for h in (self.stdout, self.stderr)]
        return out[0], out[1]

    def _collected(self, handle: Any) -> Any:
        if handle is None:
            return None
        fd = handle.fileno() if not handle.closed else None
        data = b"".join(self._chunks.get(fd, [])) if fd is not None else b""
        if not handle.closed:
            handle.close()
        if not self._text:
            return data
        return data.decode().replace("\r\n", "\n").replace("\r", "\n")  # Popen's universal newlines

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            os.kill(self.pid, sig)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


def popen(cmd: list[str], env: dict[str, str] | None = None, *, code: bool = False,
          stdin: Any = None, stdout: Any = None, stderr: Any = None, text: bool = False,
          start_new_session: bool = False, cwd: str | None = None) -> subprocess.Popen | WarmProcess:
    """``subprocess.Popen(cmd, ...)``, forked warm when the module docstring's rules allow. ``python -c``
    code is forked warm only when ``code`` says so: code that looks at what an interpreter has imported,
    or limits its address space, must start cold."""
    full_env = dict(os.environ if env is None else env)
    argv = _warm_argv(cmd, code)
    kind = next((k for k in KINDS if k.accepts(full_env)), None) if argv is not None else None
    if kind is None:
        return subprocess.Popen(cmd, env=full_env, stdin=stdin, stdout=stdout, stderr=stderr, text=text,
                                start_new_session=start_new_session, cwd=cwd)
    return WarmProcess(
        _interpreter(kind),
        cmd,
        argv,
        full_env,
        stdin=stdin,
        stdout=stdout,
        stderr=stderr,
        text=text,
        new_session=start_new_session,
        cwd=cwd,
    )


def run(cmd: list[str], env: dict[str, str] | None = None, *, timeout: float | None = None, stdin: Any = None,
        stdout: Any = None, stderr: Any = None, capture_output: bool = False, text: bool = False,
        code: bool = False, cwd: str | None = None) -> subprocess.CompletedProcess:
    """``subprocess.run(cmd, ...)`` through :func:`popen`."""
    if capture_output:
        stdout = stderr = subprocess.PIPE
    proc = popen(cmd, env, code=code, stdin=stdin, stdout=stdout, stderr=stderr, text=text, cwd=cwd)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.communicate()
        raise
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


if __name__ == "__main__" and sys.argv[1:2] == ["--serve"]:
    sys.path.pop(0)  # this file's folder: the children's imports resolve as the installed scripts' do
    _run = _serve(sys.argv[2], sys.argv[3:])
    if _run is not None:
        _run_child(_run)
