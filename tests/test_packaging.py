"""The sdist as users get it: the license as an SPDX expression with its file, and no tests.

Built from a copy of the checkout (tracked and new files, as git lists them) so that nothing
is written into the repository.
"""

from __future__ import annotations

import importlib.util
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
LICENSE_WARNING = "project.license` as a TOML table is deprecated"


def _checkout_files() -> list[str]:
    if not (REPO / ".git").exists() or shutil.which("git") is None:
        pytest.skip("needs a git checkout: the sdist is built from the files git lists")
    listed = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard"], cwd=REPO,
                            capture_output=True, text=True, check=True).stdout.splitlines()
    return [name for name in listed if (REPO / name).is_file()]  # a file deleted but not yet committed


def _has_build() -> bool:
    """PyPA's ``build`` installed (a bare ``build/`` directory on the path is a namespace package)."""
    try:
        return importlib.util.find_spec("build.__main__") is not None
    except ModuleNotFoundError:
        return False


@pytest.fixture(scope="module")
def sdist(tmp_path_factory) -> tuple[dict[str, bytes], str]:
    """``({path inside the sdist: bytes}, build output)``."""
    work = tmp_path_factory.mktemp("sdist")
    src, out = work / "src", work / "out"
    for name in _checkout_files():
        (src / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(REPO / name, src / name)
    if _has_build():
        cmd = [sys.executable, "-m", "build", "--sdist", "--no-isolation", "--outdir", str(out)]
    else:
        cmd = [sys.executable, "setup.py", "sdist", "--dist-dir", str(out)]
    done = subprocess.run(cmd, cwd=src, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    (archive,) = out.glob("*.tar.gz")
    with tarfile.open(archive) as tar:
        members = {m.name.split("/", 1)[1]: tar.extractfile(m).read() for m in tar.getmembers()
                   if m.isfile() and "/" in m.name}
    return members, done.stdout + done.stderr


def test_sdist_ships_the_package_and_the_license_but_no_tests(sdist):
    members, _ = sdist
    assert not [name for name in members if name.startswith("tests/")]
    for name in (
        "LICENSE",
        "README.md",
        "pyproject.toml",
        "setup.py",
        "dspark_cache/loader/csrc/batch_fill.c",
        "dspark_cache/format/csrc/xxh3.h",
        "dspark_cache/format/tar/csrc/append.c",
    ):
        assert name in members, name
    package = [
        name for name in _checkout_files() if name.startswith("dspark_cache/") and name.endswith(".py")
    ]
    assert package and not [name for name in package if name not in members]


def test_license_is_an_spdx_expression_with_the_full_text(sdist):
    members, output = sdist
    pkg_info = members["PKG-INFO"].decode()
    assert "License-Expression: Apache-2.0" in pkg_info.splitlines()
    assert "License-File: LICENSE" in pkg_info.splitlines()
    assert LICENSE_WARNING not in output
    text = members["LICENSE"].decode()
    assert text == (REPO / "LICENSE").read_text()
    assert "Apache License" in text and "Version 2.0, January 2004" in text
    assert "END OF TERMS AND CONDITIONS" in text  # the whole license, not a pointer to it
