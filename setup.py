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
            # Only our own C, and the C library: checksums are the `xxhash` package's (loader/verify.py).
            sources=["dspark_cache/loader/csrc/batch_fill.c"],
            extra_compile_args=["-O3", "-std=gnu11"],
            optional=True,
        )
    ]
)
