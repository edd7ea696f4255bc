"""Our optional C extensions, loaded one way: present, built from these sources, and not switched off.

The loader's batch filler and the shard writer are C, called through ctypes (which releases the
GIL around each call). Each is optional: without a C compiler at install time the same work runs
in Python, slower, and a warning says so once. An extension built from other sources (its ABI
number differs from the one its Python side expects) is not called: ctypes would misread its
records. ``DSPARK_NATIVE=0`` asks for the Python paths (the tests run both).
"""

from __future__ import annotations

import ctypes
import importlib
import logging
import os

log = logging.getLogger(__name__)

REBUILD = "`pip install -e .` in the checkout (or `rm .venv/.installed && make setup`)"


def load_extension(module: str, abi_function: str, abi: int, what: str) -> ctypes.CDLL | None:
    """The extension ``module`` as a ctypes library when its ``abi_function()`` returns ``abi``; else
    ``None``, with a warning naming ``what`` runs in Python instead and how to build it."""
    try:
        extension = importlib.import_module(module)
    except ImportError:
        log.warning("the native %s is not built (no C compiler when dspark-cache was installed?): it runs in "
                    "Python, slower; install gcc, then %s to build it", what, REBUILD)
        return None
    lib = ctypes.CDLL(extension.__file__)
    function = getattr(lib, abi_function, None)
    built = function() if function is not None else None
    if built != abi:
        log.warning("the native %s at %s was built from other sources (ABI %s, these are %s): it runs in "
                    "Python, slower, until it is rebuilt: %s", what, extension.__file__, built, abi, REBUILD)
        return None
    return lib


def native_wanted() -> bool:
    """False when ``DSPARK_NATIVE=0`` asks for the Python paths."""
    return os.environ.get("DSPARK_NATIVE", "1") != "0"
