"""Compiled-code primitives on raw memory, shared by the pool's team (`team.py`) and
jlora's FFI kernels (`jlora.model.host.ffi`), which Numba has no words for:

- `pointer(address)`: an int64 address as a void*, what `numba.carray` views;
- `load`, `store`, `swap_if`: an acquire load, a release store and an atomic
  compare-exchange of one word of an int64[::1] array.

Imports no jax: cpu_offload never does.
"""

from __future__ import annotations

from numba import types
from numba.core import cgutils
from numba.extending import intrinsic


@intrinsic
def pointer(typingctx, address):  # pragma: no cover - compiled
    """The int64 `address` as a void* (what `carray` reads, given a dtype)."""

    def codegen(context, builder, sig, args):
        return builder.inttoptr(args[0], context.get_value_type(types.voidptr))

    return types.voidptr(types.int64), codegen


def _word(context, builder, array_type, array, index):
    """The address of array[index] (an int64[::1])."""
    view = context.make_array(array_type)(context, builder, value=array)
    return cgutils.gep(builder, view.data, index)


@intrinsic
def load(typingctx, array, index):  # pragma: no cover - compiled
    """array[index], an acquire load."""

    def codegen(context, builder, sig, args):
        return builder.load_atomic(_word(context, builder, sig.args[0], *args), "acquire", 8)

    return types.int64(array, index), codegen


@intrinsic
def store(typingctx, array, index, value):  # pragma: no cover - compiled
    """array[index] = value, a release store."""

    def codegen(context, builder, sig, args):
        word = _word(context, builder, sig.args[0], args[0], args[1])
        builder.store_atomic(args[2], word, "release", 8)
        return context.get_dummy_value()

    return types.none(array, index, value), codegen


@intrinsic
def swap_if(typingctx, array, index, expected, value):  # pragma: no cover - compiled
    """array[index] = value if it was `expected`, atomically: whether it was."""

    def codegen(context, builder, sig, args):
        word = _word(context, builder, sig.args[0], args[0], args[1])
        result = builder.cmpxchg(word, args[2], args[3], "acq_rel", "acquire")
        return builder.extract_value(result, 1)

    return types.boolean(array, index, expected, value), codegen
