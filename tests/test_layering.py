"""The layout shows the architecture: file names live in one module, arrows point one way."""

from __future__ import annotations

import ast
import pathlib
import re
import subprocess
import sys

import pytest

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


TESTS = PACKAGE.parent / "tests"
# A cache file's name as a whole string (alone or ending a path): what tests write as CachePaths(...).x
# (NeMo's layout: nemo/nemo_format's path functions).
_CACHE_FILE = re.compile(
    r"(?:^|/)(?:manifest\.json|target_weights\.safetensors|lease\.json|wids-index\.json|plan\.json"
    r"|shard-\d{6,}\.(?:tar|idx|safetensors)(?:\.partial)?|rank-\d{5,}\.jsonl?(?:\.\d{6,})?"
    r"|part-\d{5}\.\w+(?:\.npy)?)$",
    re.ASCII)  # ASCII digits: ours (a name with others is a hostile test's plant)
_CACHE_DIRS = {"shards", "status", "events", "control", "plan", "logs"}
_FORMATTED = ("shard-", "rank-", "part-", "shards/", "status/", "events/", "control/", "plan/")
_DIR_CALLS = {"os.path.join", "open", "os.open", "os.makedirs", "os.mkdir", "os.listdir"}
_DIR_METHODS = {"list", "rglob", "key", "head", "delete", "upload", "download"}
# Spellings tests keep on purpose, by file: NeMo's own layout (its writer's oracle, not ours), files planted
# under wrong or near-miss names, the node replica's own bookkeeping names, and the layout asserted as is.
TEST_SPELLINGS: dict[str, set[str]] = {
    "tests/test_layering.py": {"manifest.json", "target_weights.safetensors"},  # NAMES, the package's rule
    # NeMo's layout written or read as NeMo's own code does, independently of nemo/nemo_format.py.
    "tests/support/nemo_fixture.py": {"manifest.json", "target_weights.safetensors",
                                      "f'shard-{start // shard_size:06d}.safetensors'"},
    "tests/support/convert_fixture.py": {"manifest.json", "target_weights.safetensors",
                                         "f'shard-{shard:06d}.safetensors'"},
    "tests/nemo/parity/compare.py": {"manifest.json", "target_weights.safetensors"},
    "tests/nemo/parity/run.py": {"logs"},  # the parity run's own log directory, not a cache's
    # A download temporary of the node's replica (storage/remote), named as it names them.
    "tests/storage/test_remote_reading.py": {"f'shard-000002.tar.{os.getpid()}.1'"},
}


def _test_spellings(tree: ast.AST):
    """Cache file names spelled in a test: a whole string naming one, an f-string starting like one, a
    cache directory's bare name given to a path call or a store's method."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str) \
                and not re.search(r"\s", node.value) and _CACHE_FILE.search(node.value):
            yield node.lineno, node.value
        if isinstance(node, ast.JoinedStr) and node.values and isinstance(node.values[0], ast.Constant) \
                and str(node.values[0].value).startswith(_FORMATTED) and not any(
                    isinstance(part, ast.Constant) and re.search(r"\s", part.value) for part in node.values):
            yield node.lineno, ast.unparse(node)
        if isinstance(node, ast.Call):
            name = ast.unparse(node.func)
            method = isinstance(node.func, ast.Attribute) and node.func.attr in _DIR_METHODS
            if name in _DIR_CALLS or method:
                yield from ((arg.lineno, arg.value) for arg in node.args if isinstance(arg, ast.Constant)
                            and arg.value in _CACHE_DIRS)


def test_tests_name_cache_files_through_cache_paths():
    """Tests spell a cache's files as the package does (CachePaths), so that a renamed file is renamed in
    one place; the exceptions are listed, by file, in TEST_SPELLINGS."""
    offenders = []
    for path in sorted(TESTS.rglob("*.py")):
        where = path.relative_to(TESTS.parent).as_posix()
        allowed = TEST_SPELLINGS.get(where, set())
        for line, text in _test_spellings(ast.parse(path.read_text())):
            if text not in allowed:
                offenders.append(f"{where}:{line}: {text!r}")
    assert not offenders, "cache names spelled in tests, not through CachePaths:\n" + "\n".join(offenders)


def test_parts_never_import_each_other():
    """producer, loader, tui and verify import format (and the library), never one another."""
    parts = ("producer", "loader", "tui", "verify")
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


def _modules() -> dict[str, pathlib.Path]:
    """Every module of the package by its dotted name (a package by its own name)."""
    out = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


def _run_imports(tree: ast.AST, typing_too: bool = False) -> list[ast.Import | ast.ImportFrom]:
    """The import statements that run: at module level and inside functions; those under TYPE_CHECKING
    only with ``typing_too`` (a type-only import still ties two modules' meanings together)."""
    guards = ("TYPE_CHECKING", "typing.TYPE_CHECKING")
    typing_only = (
        set()
        if typing_too
        else {
            id(node)
            for branch in ast.walk(tree)
            if isinstance(branch, ast.If) and ast.unparse(branch.test) in guards
            for statement in branch.body
            for node in ast.walk(statement)
        }
    )
    return [node for node in ast.walk(tree)
            if isinstance(node, (ast.Import, ast.ImportFrom)) and id(node) not in typing_only]


def _targets(module: str, path: pathlib.Path, node: ast.Import | ast.ImportFrom,
             modules: dict[str, pathlib.Path]) -> set[str]:
    """The package's modules one import statement loads by name: a name imported from a package is
    that package, unless the package has a module of that name."""
    if isinstance(node, ast.Import):
        names = [alias.name for alias in node.names]
    else:
        base = node.module or ""
        if node.level:
            package = module.split(".") if path.name == "__init__.py" else module.split(".")[:-1]
            anchor = ".".join(package[:len(package) - node.level + 1])
            base = f"{anchor}.{base}" if base else anchor
        names = [
            f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base for alias in node.names
        ]
    out = set()
    for name in names:
        while name and name not in modules:
            name = name.rpartition(".")[0]
        if name and name != module:
            out.add(name)
    return out


def _import_graph(typing_too: bool = False) -> dict[str, set[str]]:
    """Module -> the package's modules it imports (every statement that runs, see :func:`_run_imports`)."""
    modules = _modules()
    return {module: {target for node in _run_imports(ast.parse(path.read_text()), typing_too)
                     for target in _targets(module, path, node, modules)}
            for module, path in modules.items()}


def _cycle(graph: dict[str, set[str]]) -> list[str]:
    """One import cycle, its modules in import order with the first repeated at the end; [] if none."""
    done: set[str] = set()
    path: list[str] = []

    def visit(module: str) -> list[str]:
        path.append(module)
        for target in sorted(graph[module]):
            if target in path:
                return path[path.index(target):] + [target]
            if target not in done:
                found = visit(target)
                if found:
                    return found
        done.add(path.pop())
        return []

    for module in sorted(graph):
        found = [] if module in done else visit(module)
        if found:
            return found
    return []


def test_no_import_cycles():
    """No module imports, directly or through others, one that imports it back (function-local and
    ``TYPE_CHECKING`` imports count: a cycle closed by a type-only import is still one idea in two places)."""
    graph = _import_graph(typing_too=True)
    assert len(graph) > 100 and graph["dspark_cache.verify.cli"], sorted(graph)
    cycle = _cycle(graph)
    assert not cycle, "import cycle: " + " -> ".join(cycle)


def _layer_offenders(layer: str, allowed: tuple[str, ...]) -> list[str]:
    """Imports (type-only ones included) from modules of ``layer`` to package modules outside ``allowed``."""
    graph, modules = _import_graph(typing_too=True), _modules()
    return sorted(f"{modules[m].relative_to(PACKAGE).as_posix()} imports {t}"
                  for m, targets in graph.items() if m.startswith(f"dspark_cache.{layer}")
                  for t in targets if not t.startswith(tuple(f"dspark_cache.{a}" for a in allowed)))


def test_format_reads_on_its_own():
    """``format``, the on-disk contract, imports nothing of the package outside itself (no storage, no
    part) and no object-store client: someone reading the contract reads one folder."""
    offenders = _layer_offenders("format", ("format",))
    clients = ("obstore", "boto3", "botocore", "s3fs", "fsspec")
    for path in sorted((PACKAGE / "format").rglob("*.py")):
        for node in _run_imports(ast.parse(path.read_text()), typing_too=True):
            names = [node.module or ""] if isinstance(node, ast.ImportFrom) else [a.name for a in node.names]
            offenders += [
                f"{path.relative_to(PACKAGE)} imports {n}" for n in names if n.split(".")[0] in clients
            ]
    assert _modules()["dspark_cache.format.paths"] and not offenders, "\n".join(offenders)


def test_storage_stands_on_format_alone():
    """``storage`` (where a cache lives: a directory, its lock, object storage) imports only the contract;
    the parts that read and write caches import it, never the other way round."""
    assert "dspark_cache.storage.remote.store" in _modules()
    offenders = _layer_offenders("storage", ("format", "storage"))
    assert not offenders, "\n".join(offenders)


@pytest.mark.parametrize("part", ["nemo", "regenerate"])
def test_tools_use_only_the_producers_public_names(part):
    """nemo (dspark-convert included) and regenerate take from the producer only what
    ``dspark_cache.producer`` exports."""
    import dspark_cache.producer

    modules = _modules()
    offenders = []
    for module, path in modules.items():
        if not module.startswith(f"dspark_cache.{part}"):
            continue
        for node in _run_imports(ast.parse(path.read_text())):
            if not any(t.startswith("dspark_cache.producer") for t in _targets(module, path, node, modules)):
                continue
            names = [alias.name for alias in node.names]
            if not (isinstance(node, ast.ImportFrom) and node.module == "dspark_cache.producer"
                    and set(names) <= set(dspark_cache.producer.__all__)):
                offenders.append(f"{path.relative_to(PACKAGE)}:{node.lineno}: {ast.unparse(node)}")
    assert not offenders, f"{part} imports producer internals:\n" + "\n".join(offenders)


def test_regenerate_stands_before_the_cache():
    """regenerate makes the producer's input: it never imports the cache's readers (loader, monitor,
    verifier) nor the NeMo converter, and nothing but its own dispatcher imports it."""
    graph = _import_graph()
    ours = {m: targets for m, targets in graph.items() if m.startswith("dspark_cache.regenerate")}
    assert "dspark_cache.regenerate.run" in ours
    banned = tuple(f"dspark_cache.{p}" for p in ("loader", "tui", "verify", "nemo"))
    offenders = sorted(
        f"{m} imports {t}" for m, targets in ours.items() for t in targets if t.startswith(banned)
    )
    offenders += sorted(
        f"{m} imports {t}"
        for m, targets in graph.items()
        if not m.startswith("dspark_cache.regenerate") and m != "dspark_cache.cli"
        for t in targets
        if t.startswith("dspark_cache.regenerate")
    )
    assert not offenders, "\n".join(offenders)


def test_console_scripts_follow_one_pattern():
    """Every console script is a function of ``dspark_cache.cli``, which dispatches to its part; no part
    imports ``dspark_cache.cli`` back (only the ``python -m`` entries, ``__main__.py``, start from it)."""
    import tomllib

    scripts = tomllib.loads((PACKAGE.parent / "pyproject.toml").read_text())["project"]["scripts"]
    assert scripts and all(target.startswith("dspark_cache.cli:") for target in scripts.values()), scripts
    graph, modules = _import_graph(), _modules()
    offenders = sorted(modules[m].relative_to(PACKAGE).as_posix() for m, targets in graph.items()
                       if "dspark_cache.cli" in targets and not m.startswith("dspark_cache.cli")
                       and not m.endswith(".__main__"))
    assert not offenders, "parts that import their dispatcher dspark_cache.cli: " + ", ".join(offenders)


def test_the_producers_top_level_stays_small():
    """The producer shows its stages: at most a dozen modules at its top, the rest in sub-packages."""
    top = sorted(path.name for path in (PACKAGE / "producer").glob("*.py"))
    assert len(top) <= 12, top


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
    for code in (
        "import runpy, sys\nsys.argv = ['dspark-verify', '--help']\n"
        "try:\n    runpy.run_module('dspark_cache.verify', run_name='__main__')\nexcept SystemExit:\n    pass",
        # the console script as installed (pyproject's dspark-verify = "dspark_cache.cli:verify")
        "from importlib.metadata import entry_points\n"
        "main = entry_points(group='console_scripts')['dspark-verify'].load()\n"
        "try:\n    main(['--help'])\nexcept SystemExit:\n    pass",
    ):
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
        assert ("usage:" in out) if argv == ["--help"] else ("EXIT 2" in out and "--target-model" in err), (
            out + err
        )
        chain = [line for line in err.splitlines() if "torch" in line or "dspark_cache" in line]
        assert not torch_loaded, "torch imported by:\n" + "\n".join(chain[-40:])
