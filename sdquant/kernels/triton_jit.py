"""Jitting Triton kernels per interpreter mode, so one process can run both compiled kernels and the CPU
interpreter (how CI tests kernels).

``triton.jit`` reads TRITON_INTERPRET when it wraps a function, and a kernel resolves the @jit helpers it calls
by name in its globals when it is compiled. So each mode needs its own namespace: a copy of the module's
globals where the helpers are re-jitted, and kernel clones whose globals are that copy. Triton's own @jit
library functions (tl.sum, tl.max, tl.zeros, ...) were wrapped once, at triton's import, and cannot run in an
interpreter switched on later: kernels built this way use builtins and their own helpers (e.g. ``tl.reduce``
with a helper combine function) instead.
"""
from __future__ import annotations

import types
from typing import Callable, Sequence


def jit_in_namespace(module_globals: dict, kernels: Sequence[Callable], helpers: Sequence[Callable] = ()) -> tuple:
    """Return ``triton.jit`` clones of ``kernels`` (in order) that call ``helpers`` jitted for the current mode.
    Each clone keeps its function's ``__annotations__``: that is where the ``tl.constexpr`` marks live
    (a clone without them has no constexpr parameters, and a GPU launch then fails to specialize them)."""
    import triton
    ns = dict(module_globals)

    def clone(f):
        h = types.FunctionType(f.__code__, ns, f.__name__, f.__defaults__, f.__closure__)
        h.__module__, h.__qualname__, h.__doc__ = f.__module__, f.__qualname__, f.__doc__
        h.__annotations__ = dict(f.__annotations__)
        return triton.jit(h)
    for f in helpers:
        ns[f.__name__] = clone(f)
    return tuple(clone(f) for f in kernels)
