"""Borrowed views of a compiled call's state bundles: no reference counting below the entry.

numba counts references to every array it holds in a variable (NRT_incref / NRT_decref, each an
atomic read-modify-write on the array's meminfo), and a kernel that unpacks a state bundle
holds all of its arrays: ``chain_add_hop`` takes 29 references on entry and drops 30 on its
ways out, and ``coll_reply``, ``all_write``, ``_read``, ``_mutate`` and ``guard.account`` alike,
once per datagram. ``perf record`` of a node process hosting 128 NICs (all-reduce of 1 MiB on
256 NICs) put 14% of its CPU in those two functions, 20% at 64 NICs.

The arrays of a call's arguments need none of it: the Python caller holds them for the whole
call, and no kernel keeps an array past its call (they return numbers, never arrays, and write
into the arrays they were given). So an entry point rebuilds its bundles once with ``borrowed``:
the same data pointers, shapes and strides, and no meminfo (nor Python parent), which numba's
incref and decref test for and skip, as they do for ``numba.carray`` views. Arrays a kernel
allocates itself stay counted. Only entry points called from Python borrow, and only their
arguments; a borrowed array is never returned to Python.
"""

from __future__ import annotations

from typing import Any

from numba.core import cgutils
from numba.core.types.containers import BaseTuple
from numba.core.types.npytypes import Array
from numba.extending import intrinsic


def _strip(context: Any, builder: Any, ty: Any, value: Any) -> Any:
    """*value* of type *ty* with every array's meminfo and parent set to null (tuples of
    arrays, nested, element by element; anything else as it is)."""
    if isinstance(ty, Array):
        array = context.make_array(ty)(context, builder, value=value)
        array.meminfo = cgutils.get_null_value(array.meminfo.type)
        array.parent = cgutils.get_null_value(array.parent.type)
        return array._getvalue()
    if isinstance(ty, BaseTuple):
        out = value
        for index, element in enumerate(ty.types):
            item = _strip(context, builder, element, builder.extract_value(value, index))
            out = builder.insert_value(out, item, index)
        return out
    return value


@intrinsic
def borrowed(typingctx, value):
    """*value* (an array, or a named tuple of arrays and numbers, nested) with its arrays
    borrowed from the caller: valid for the call that borrowed them, never counted."""

    def codegen(context, builder, signature, args):
        return _strip(context, builder, signature.args[0], args[0])

    return value(value), codegen
