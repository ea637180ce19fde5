"""Plain Python loops compiled to machine code with numba, for the dataset index builders.

The index builders walk hundreds of millions of samples one by one; each step depends on the last, so
numpy cannot vectorise them. Megatron-LM compiles these loops from C++ at install time; here numba
compiles the same loops from Python the first time they run (numba installs from PyPI as a wheel, no
compiler needed) and caches the machine code beside the module, so later processes load it at once.
"""

from __future__ import annotations

import functools
from collections.abc import Callable


@functools.cache
def compiled(loop: Callable) -> Callable:
    """``loop`` compiled by numba (imported here, on first use: loading it takes about a second)."""
    import numba

    return numba.njit(cache=True, nogil=True)(loop)
