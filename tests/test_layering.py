"""The layout shows the architecture: file names live in one module, arrows point one way."""

from __future__ import annotations

import ast
import pathlib
import subprocess
import sys

PACKAGE = pathlib.Path(__file__).resolve().parent.parent / "dspark_cache"
# Cache file and directory names (format/paths.py); NeMo's own layout is spelled in nemo/layout.py.
NAMES = {"manifest.json", "target_weights.safetensors", "shards", "status", "events", "control", "logs",
         "lock", "stop", ".partial", ".idx", ".tar"}
PREFIXES = ("shard-", "rank-", "complete-", "control/")
OWNERS = {"format/paths.py", "nemo/layout.py"}


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
