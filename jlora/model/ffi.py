"""Numba kernels as XLA FFI handlers: host code a compiled CPU step calls with no Python
in between.

`jax.experimental.buffer_callback` hands a host function the step's buffers without a
copy, but through Python: each call takes the GIL and wraps its buffers, about 0.1-0.4
ms on this project's 2-core machine, once per layer (bench.cpu_offload: "one
buffer_callback a group, no work", 91-114 µs). A typed XLA FFI handler is a C function
XLA calls itself; a Numba `cfunc` is one. Thirty calls in a scanned step cost about 2 µs
in all (measured with a kernel that adds one to 8 floats).

A handler takes XLA's call frame (xla/ffi/api/c_api.h, `XLA_FFI_CallFrame`) and reads it
as 64-bit words:

    call frame: struct_size, extension_start, api, ctx, stage, then the arguments
                (struct_size, extension_start, size, types, args) at word 5 and the
                results (the same) at word 10: `args` and `rets` are arrays of pointers
                to buffers
    buffer:     struct_size, extension_start, dtype, data, rank, dims

and returns 0 (no error). XLA first calls it with a metadata extension, to learn which
FFI version it was built for: `answered_metadata` answers that (major 0, minor 1; XLA
takes a handler of its own major version and an older or equal minor one), and the
handler then returns at once. It works only at the execute stage. Its callers fix each
argument's shape and dtype, so a handler trusts them.

A handler that runs a parallel Numba kernel holds the launch lock (`lock`, `unlock`)
around it: Numba's workqueue threads abort the process when two threads launch at once
(two engines in one process), and no Python lock can be taken where no Python runs. The
lock is a word of this process's memory that compiled code finds by its symbol's name.
A handler is compiled in each process (a copy cached on disk crashed the next one); the
kernels it calls are cached.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import numba
import numpy as np
from llvmlite import binding, ir
from numba import carray, njit, types
from numba.extending import intrinsic

# Numba's threads: its workqueue, not GNU OpenMP, which left PyTorch in the same process
# 1.8x slower afterwards (a benchmark's transformers side: 10.9 s before a jlora run,
# 19.6 s after; 12.8 s with the workqueue, jlora as fast). Set before the first launch.
numba.config.THREADING_LAYER = "workqueue"  # type: ignore[attr-defined]

ARGS, RETS = 9, 14  # words of the call frame holding the args' and rets' pointer arrays
_STAGE, _EXECUTE = 4, 3
_METADATA = 1  # XLA_FFI_Extension_Metadata
_API_VERSION = (0, 1)  # the FFI version handlers report


@intrinsic
def _pointer(typingctx, address):  # pragma: no cover - compiled
    """The int64 `address` as a void* (what `carray` reads)."""
    signature = types.voidptr(types.int64)

    def codegen(context, builder, sig, args):
        return builder.inttoptr(args[0], context.get_value_type(types.voidptr))

    return signature, codegen


_LOCK_SYMBOL = "jlora_ffi_launch_lock"
_LOCK = np.zeros(1, np.int64)  # 0: free; lives as long as the process
binding.add_symbol(_LOCK_SYMBOL, _LOCK.ctypes.data)


@intrinsic
def _try_lock(typingctx):  # pragma: no cover - compiled
    """Atomically take the launch lock if it is free: whether it was."""

    def codegen(context, builder, sig, args):
        word = builder.module.globals.get(_LOCK_SYMBOL) or ir.GlobalVariable(
            builder.module, ir.IntType(64), _LOCK_SYMBOL
        )
        zero, one = ir.Constant(ir.IntType(64), 0), ir.Constant(ir.IntType(64), 1)
        result = builder.cmpxchg(word, zero, one, "acquire", "monotonic")
        return builder.extract_value(result, 1)

    return types.boolean(), codegen


@intrinsic
def _unlock(typingctx):  # pragma: no cover - compiled
    """Free the launch lock (a release store)."""

    def codegen(context, builder, sig, args):
        word = builder.module.globals.get(_LOCK_SYMBOL) or ir.GlobalVariable(
            builder.module, ir.IntType(64), _LOCK_SYMBOL
        )
        builder.store_atomic(ir.Constant(ir.IntType(64), 0), word, "release", 8)
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


@njit(inline="always")
def words(address, count):  # pragma: no cover - compiled
    """`count` int64 words from `address` (an int64; the frame itself is a void*)."""
    return carray(_pointer(address), count, dtype=np.int64)


@njit(inline="always")
def answered_metadata(frame):  # pragma: no cover - compiled
    """True where XLA asked for the handler's metadata (it is then answered), or calls
    it at a stage other than execute: the handler returns 0 at once."""
    header = carray(frame, 5, dtype=np.int64)
    extension = header[1]
    if extension != 0:
        base = words(extension, 4)  # struct_size, type (+ padding), next, metadata
        if base[1] & 0xFFFFFFFF == _METADATA:
            metadata = base[3]
            version = carray(_pointer(metadata + 24), 2, dtype=np.int32)
            version[0], version[1] = _API_VERSION
            carray(_pointer(metadata + 32), 1, dtype=np.uint32)[0] = 0  # no traits
        return True
    return header[_STAGE] & 0xFFFFFFFF != _EXECUTE


@njit(inline="always")
def buffer(frame, word, index):  # pragma: no cover - compiled
    """(data address, dims address) of argument (word `ARGS`) or result (`RETS`)
    `index`."""
    pointers = words(carray(frame, RETS + 1, dtype=np.int64)[word], index + 1)
    fields = words(pointers[index], 6)
    return fields[3], fields[5]


@njit(inline="always")
def array_1d(frame, word, index, dtype):  # pragma: no cover - compiled
    """Argument or result `index` of 1 dim, in place."""
    data, dims = buffer(frame, word, index)
    return carray(_pointer(data), (words(dims, 1)[0],), dtype=dtype)


@njit(inline="always")
def array_2d(frame, word, index, dtype):  # pragma: no cover - compiled
    """Argument or result `index` of 2 dims, in place."""
    data, dims = buffer(frame, word, index)
    d = words(dims, 2)
    return carray(_pointer(data), (d[0], d[1]), dtype=dtype)


@njit(inline="always")
def array_3d(frame, word, index, dtype):  # pragma: no cover - compiled
    """Argument or result `index` of 3 dims, in place."""
    data, dims = buffer(frame, word, index)
    d = words(dims, 3)
    return carray(_pointer(data), (d[0], d[1], d[2]), dtype=dtype)


@njit(inline="always")
def array_5d(frame, word, index, dtype):  # pragma: no cover - compiled
    """Argument or result `index` of 5 dims, in place."""
    data, dims = buffer(frame, word, index)
    d = words(dims, 5)
    return carray(_pointer(data), (d[0], d[1], d[2], d[3], d[4]), dtype=dtype)


@njit(inline="always")
def scalar(frame, word, index, dtype):  # pragma: no cover - compiled
    """Argument or result `index`, a scalar (its dims are not read: rank 0)."""
    data, _ = buffer(frame, word, index)
    return carray(_pointer(data), 1, dtype=dtype)[0]


@functools.cache
def register(name: str, handler: Any) -> str:
    """Register the Numba cfunc `handler` as the CPU FFI target `name` (once a process)."""
    jax.ffi.register_ffi_target(name, jax.ffi.pycapsule(handler.ctypes), platform="cpu")
    return name


def call(name: str, handler: Any, result: jax.ShapeDtypeStruct, *args: Any) -> jax.Array:
    """The CPU FFI target `name` (the cfunc `handler`, registered on first use) as an op
    of the step being traced, on `args`."""
    return jax.ffi.ffi_call(register(name, handler), result)(*args)
