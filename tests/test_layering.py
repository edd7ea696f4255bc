"""The layout shows the architecture: file names live in one module, arrows point one way."""

from __future__ import annotations

import ast
import pathlib
import subprocess
import sys

PACKAGE = pathlib.Path(__file__).resolve().parent.parent / "dspark_cache"
# Cache file and directory names (format/paths.py); NeMo's own format is spelled in nemo/nemo_format.py.
NAMES = {"manifest.json", "target_weights.safetensors", "shards", "status", "events", "control", "logs",
         "lock", "stop", ".partial", ".idx", ".tar"}
PREFIXES = ("shard-", "rank-", "complete-", "control/")
OWNERS = {"format/paths.py", "nemo/nemo_format.py"}


def _path_strings(tree: ast.AST):
    """String literals that can end up in a path: arguments of os.path.join / open / os.open, and
    the leading text of f-strings and constants."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            name = ast.unparse(node.func)
            if name in ("os.path.join", "open", "os.open", "os.makedirs", "os.mkdir"):
                for arg in node.args:
                    if isinstance(arg, ast.Constant) and isinstance(arg.value, str):
                        yield arg.lineno, arg.value
        if isinstance(node, ast.JoinedStr) and node.values and isinstance(node.values[0], ast.Constant):
            yield node.lineno, str(node.values[0].value)
        if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add):
            for side in (node.left, node.right):
                if isinstance(side, ast.Constant) and isinstance(side.value, str):
                    yield side.lineno, side.value


def test_only_paths_spells_cache_file_names():
    offenders = []
    for path in sorted(PACKAGE.rglob("*.py")):
        where = path.relative_to(PACKAGE).as_posix()
        if where in OWNERS:
            continue
        for line, text in _path_strings(ast.parse(path.read_text())):
            if text in NAMES or text.startswith(PREFIXES):
                offenders.append(f"dspark_cache/{where}:{line}: {text!r}")
    assert not offenders, "cache file names spelled outside format/paths.py:\n" + "\n".join(offenders)


def test_parts_never_import_each_other():
    """producer, loader and tui import format (and the library), never one another."""
    parts = ("producer", "loader", "tui")
    offenders = []
    for part in parts:
        for path in sorted((PACKAGE / part).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text())):
                module = node.module if isinstance(node, ast.ImportFrom) else None
                names = [module] if module else [a.name for a in getattr(node, "names", [])] \
                    if isinstance(node, ast.Import) else []
                for name in names:
                    for other in parts:
                        if other != part and name and name.startswith(f"dspark_cache.{other}"):
                            offenders.append(f"{path.relative_to(PACKAGE)} imports {name}")
    assert not offenders, "\n".join(offenders)


def test_monitor_never_imports_torch():
    code = "import sys, dspark_cache.tui.app, dspark_cache.tui.cli; print('torch' in sys.modules)"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.stdout.strip() == "False", done.stderr


def _imports_torch(code: str, *args: str) -> tuple[bool, str, str]:
    """Run ``code`` in a fresh interpreter: whether torch ended up in ``sys.modules``, its output."""
    probe = code + "\nimport sys\nprint('TORCH' if 'torch' in sys.modules else 'NO-TORCH')"
    done = subprocess.run([sys.executable, *args, "-c", probe], capture_output=True, text=True, timeout=120)
    last = done.stdout.strip().splitlines()[-1:]
    assert last in (["TORCH"], ["NO-TORCH"]), done.stdout + done.stderr
    return last == ["TORCH"], done.stdout, done.stderr


def test_format_never_imports_torch():
    """Every module of the on-disk contract loads without torch (the verifier and monitor pay nothing)."""
    code = ("import importlib, pkgutil, dspark_cache.format as f\n"
            "names = [m.name for m in pkgutil.walk_packages(f.__path__, 'dspark_cache.format.')]\n"
            "assert len(names) > 10, names\n"
            "[importlib.import_module(n) for n in names]")
    torch_loaded, _, err = _imports_torch(code)
    assert not torch_loaded, err


def test_verify_help_never_imports_torch():
    """``dspark-verify --help`` (module and console script) imports no torch; -X importtime names the chain."""
    for code in ("import runpy, sys\nsys.argv = ['dspark-verify', '--help']\n"
                 "try:\n    runpy.run_module('dspark_cache.verify', run_name='__main__')\nexcept SystemExit:\n    pass",
                 # the console script as installed (pyproject's dspark-verify = "dspark_cache.cli:verify")
                 "from importlib.metadata import entry_points\n"
                 "main = entry_points(group='console_scripts')['dspark-verify'].load()\n"
                 "try:\n    main(['--help'])\nexcept SystemExit:\n    pass"):
        torch_loaded, out, err = _imports_torch(code, "-X", "importtime")
        assert "usage:" in out, out + err  # --help really ran
        chain = [line for line in err.splitlines() if "torch" in line or "dspark_cache" in line]
        assert not torch_loaded, "torch imported by:\n" + "\n".join(chain[-40:])


def test_produce_help_never_imports_torch():
    """``dspark-produce --help`` and a usage error parse the producer's options without torch."""
    for argv in (["--help"], ["--input-data", "x"]):
        code = ("from importlib.metadata import entry_points\n"
                "main = entry_points(group='console_scripts')['dspark-produce'].load()\n"
                f"try:\n    main({argv!r})\nexcept SystemExit as exc:\n    print('EXIT', exc.code)")
        torch_loaded, out, err = _imports_torch(code, "-X", "importtime")
        assert ("usage:" in out) if argv == ["--help"] else ("EXIT 2" in out and "--target-model" in err), out + err
        chain = [line for line in err.splitlines() if "torch" in line or "dspark_cache" in line]
        assert not torch_loaded, "torch imported by:\n" + "\n".join(chain[-40:])
