"""Builds the optional native parts; everything else is in pyproject.toml.

The loader's batch filler and the shard writer's hot loop are C. Both extensions are optional:
without a C compiler the install still succeeds and the same work runs in Python, slower
(`dspark_cache.loader.fill.native_available()` and `dspark_cache.format.tar.append.native_available()`
say which one runs). Both hash with our own XXH3-64, `dspark_cache/format/csrc/xxh3.h`.
"""

from setuptools import Extension, setup


def native(module: str, source: str) -> Extension:
    """Only our own C (format/csrc/xxh3.h is our XXH3-64) and the C library; optional (see above)."""
    return Extension(module, sources=[source], depends=["dspark_cache/format/csrc/xxh3.h"],
                     extra_compile_args=["-O3", "-std=gnu11"], optional=True)


setup(
    ext_modules=[
        native("dspark_cache.loader._batch_fill", "dspark_cache/loader/csrc/batch_fill.c"),
        native("dspark_cache.format.tar._append", "dspark_cache/format/tar/csrc/append.c"),
    ]
)
