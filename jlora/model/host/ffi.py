"""Numba kernels as XLA FFI handlers: host code a compiled CPU step calls with no Python
in between.

`jax.experimental.buffer_callback` hands a host function the step's buffers without a
copy, but through Python: each call takes the GIL and wraps its buffers, a tenth of a
millisecond or more, once per layer. A typed XLA FFI handler is a C function XLA calls
itself; a Numba `cfunc` is one. A scanned step's thirty such calls cost a few
microseconds in all.

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

A handler that runs a parallel Numba kernel holds the process's launch lock around it
(`cpu_offload.kernels.threads`: Numba's workqueue threads abort the process when two threads
launch at once, as two engines decoding in one process would). A handler is compiled
in each process (a copy cached on disk crashed the next one); the kernels it calls are
cached. Addresses become pointers by `cpu_offload.kernels.native.pointer`.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import numpy as np
from numba import carray, njit

from cpu_offload.kernels.native import pointer

ARGS, RETS = 9, 14  # words of the call frame holding the args' and rets' pointer arrays
_STAGE, _EXECUTE = 4, 3
_METADATA = 1  # XLA_FFI_Extension_Metadata
_API_VERSION = (0, 1)  # the FFI version handlers report


@njit(inline="always")
def words(address, count):  # pragma: no cover - compiled
    """`count` int64 words from `address` (an int64; the frame itself is a void*)."""
    return carray(pointer(address), count, dtype=np.int64)


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
            version = carray(pointer(metadata + 24), 2, dtype=np.int32)
            version[0], version[1] = _API_VERSION
            carray(pointer(metadata + 32), 1, dtype=np.uint32)[0] = 0  # no traits
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
    return carray(pointer(data), (words(dims, 1)[0],), dtype=dtype)


@njit(inline="always")
def array_2d(frame, word, index, dtype):  # pragma: no cover - compiled
    """Argument or result `index` of 2 dims, in place."""
    data, dims = buffer(frame, word, index)
    d = words(dims, 2)
    return carray(pointer(data), (d[0], d[1]), dtype=dtype)


@njit(inline="always")
def array_3d(frame, word, index, dtype):  # pragma: no cover - compiled
    """Argument or result `index` of 3 dims, in place."""
    data, dims = buffer(frame, word, index)
    d = words(dims, 3)
    return carray(pointer(data), (d[0], d[1], d[2]), dtype=dtype)


@njit(inline="always")
def array_5d(frame, word, index, dtype):  # pragma: no cover - compiled
    """Argument or result `index` of 5 dims, in place."""
    data, dims = buffer(frame, word, index)
    d = words(dims, 5)
    return carray(pointer(data), (d[0], d[1], d[2], d[3], d[4]), dtype=dtype)


@njit(inline="always")
def scalar(frame, word, index, dtype):  # pragma: no cover - compiled
    """Argument or result `index`, a scalar (its dims are not read: rank 0)."""
    data, _ = buffer(frame, word, index)
    return carray(pointer(data), 1, dtype=dtype)[0]


@functools.cache
def register(name: str, handler: Any) -> str:
    """Register the Numba cfunc `handler` as the CPU FFI target `name` (once a process)."""
    jax.ffi.register_ffi_target(name, jax.ffi.pycapsule(handler.ctypes), platform="cpu")
    return name


def call(name: str, handler: Any, result: jax.ShapeDtypeStruct, *args: Any) -> jax.Array:
    """The CPU FFI target `name` (the cfunc `handler`, registered on first use) as an op
    of the step being traced, on `args`."""
    return jax.ffi.ffi_call(register(name, handler), result)(*args)
