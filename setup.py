"""Builds the loader's optional native batch filler; everything else is in pyproject.toml.

The extension is optional: without a C compiler the install still succeeds and the loader runs
the same batch program in Python (slower; `dspark_cache.loader.fill.native_available()` says
which one runs).
"""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "dspark_cache.loader._batch_fill",
            # Only our own C (xxh3.h is our XXH3-64), and the C library.
            sources=["dspark_cache/loader/csrc/batch_fill.c"],
            depends=["dspark_cache/loader/csrc/xxh3.h"],
            extra_compile_args=["-O3", "-std=gnu11"],
            optional=True,
        )
    ]
)
