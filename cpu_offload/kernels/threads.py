"""Numba's threads in this project's processes: the workqueue layer, one launch at a time.

The layer is Numba's workqueue, not GNU OpenMP, whose threads spin after each launch:
they leave PyTorch in the same process nearly twice as slow after a jlora run, where
with the workqueue PyTorch loses far less and jlora runs as fast. A process takes the
layer its first parallel kernel (compiled or loaded from the cache) starts, so it is set
here, on import, and every module of the project with a parallel kernel imports this one
first. A launch costs about 0.1 ms (a 2-thread product's time against its 1-thread
time): callers split work over threads only where it is worth more.

The workqueue aborts the process when two threads launch parallel kernels at once.
XLA's threads launch them (jlora's FFI kernels, `jlora.model.host.attention`), several
at once where steps run side by side, and no Python runs there and no Python lock can
be taken. (A pool of threads splits its products with helper threads of its own,
`cpu_offload.kernels.team`, not with parallel kernels.) So the lock is a word of this
process's memory that compiled code finds by its symbol's name: `lock` takes it
(spinning while another thread holds it), `unlock` frees it; both are compiled code,
called from compiled code that holds no other lock, so a holder always gets to free it.

Code that takes the lock is compiled in each process, never cached on disk (a cached
FFI handler crashed the next process); the kernels it calls may be cached.
"""

from __future__ import annotations

import numba
import numpy as np
from llvmlite import binding, ir
from numba import njit, types
from numba.extending import intrinsic

numba.config.THREADING_LAYER = "workqueue"  # type: ignore[attr-defined]

_LOCK_SYMBOL = "jlora_numba_launch_lock"
_LOCK = np.zeros(1, np.int64)  # 0: free; lives as long as the process
binding.add_symbol(_LOCK_SYMBOL, _LOCK.ctypes.data)


def _word(builder: ir.IRBuilder) -> ir.GlobalVariable:
    """The lock's word, declared in the module being compiled."""
    return builder.module.globals.get(_LOCK_SYMBOL) or ir.GlobalVariable(
        builder.module, ir.IntType(64), _LOCK_SYMBOL
    )


@intrinsic
def _try_lock(typingctx):  # pragma: no cover - compiled
    """Atomically take the lock if it is free: whether it was."""

    def codegen(context, builder, sig, args):
        zero, one = ir.Constant(ir.IntType(64), 0), ir.Constant(ir.IntType(64), 1)
        result = builder.cmpxchg(_word(builder), zero, one, "acquire", "monotonic")
        return builder.extract_value(result, 1)

    return types.boolean(), codegen


@intrinsic
def _unlock(typingctx):  # pragma: no cover - compiled
    """Free the lock (a release store)."""

    def codegen(context, builder, sig, args):
        builder.store_atomic(ir.Constant(ir.IntType(64), 0), _word(builder), "release", 8)
        return context.get_dummy_value()

    return types.none(), codegen


@njit(inline="always")
def lock():  # pragma: no cover - compiled
    """Take the launch lock, spinning while another thread holds it."""
    while not _try_lock():
        pass


@njit(inline="always")
def unlock():  # pragma: no cover - compiled
    _unlock()
