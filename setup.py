"""Builds the loader's optional native batch filler; everything else is in pyproject.toml.

The extension is optional: without a C compiler the install still succeeds and the loader runs
the same batch program in Python (slower; `dspark_cache.loader.fill.native_available()` says
which one runs).
"""

import platform

from setuptools import Extension, setup

CSRC = "dspark_cache/loader/csrc"
sources = [f"{CSRC}/batch_fill.c", f"{CSRC}/xxhash/xxhash.c"]
# xxh3 picks SSE2, AVX2 or AVX-512 at run time, so the build needs no -march flag and runs on
# any x86-64 machine, whichever one compiled it.
macros = [("XXH_NAMESPACE", "dspark_")]
if platform.machine().lower() in ("x86_64", "amd64", "i386", "i686"):
    sources.append(f"{CSRC}/xxhash/xxh_x86dispatch.c")
    macros.append(("DSPARK_XXH_DISPATCH", "1"))

setup(
    ext_modules=[
        Extension(
            "dspark_cache.loader._batch_fill",
            sources=sources,
            define_macros=macros,
            extra_compile_args=["-O3", "-std=gnu11"],
            optional=True,
        )
    ]
)
