"""One specialization per argument type, not per constant: how calls between our kernels are
typed.

numba types a constant argument of a call from one jitted function to another as a literal
(``Literal[int](6)``, ``Literal[bool](False)``) and compiles the callee anew for every literal
value it meets: a header field's offset, an opcode, a flag. Measured on a cold cache, the node's
kernels compiled 136 specializations' worth of ``wire.wr16`` calls, 7 of ``collective._header``
and 2 of ``collective._send_chain`` (one per flag value): 113-120 s on 2 cores. Typing those
calls by the constant's type (int64, bool) instead compiles each helper once: 84 s, the same
machine code after LLVM inlines the small helpers and propagates their constants anyway.

No kernel here relies on literal dispatch (``numba.literally``, or a tuple index passed as an
argument): every kernel compiles with this in place, which the import of the kernels and the
warm-up check on every install. Calls from Python are typed by value types already.

It is a hook on numba's ``Dispatcher.get_call_template`` for the dispatchers of this package
only (numba's own and other libraries' are untouched); pyproject pins numba to the versions it
is tested on, and a numba without that method keeps its own behaviour (compiles slower).

And the other way, from Python into a kernel: ``TypedEntry`` calls a kernel whose arguments
never change type past the dispatcher's typing of each call (a host's per-call kernels).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from numba import typeof
from numba.core import dispatcher
from numba.core.types.misc import unliteral

_PACKAGE = __name__.rpartition(".")[0] + "."


def unliteral_calls() -> None:
    original = getattr(dispatcher.Dispatcher, "get_call_template", None)
    if original is None or getattr(original, "_netdam_unliteral", False):
        return

    def get_call_template(self: Any, args: Any, kws: Any) -> Any:
        if self.py_func.__module__.startswith(_PACKAGE):
            args = tuple(unliteral(a) for a in args)
            kws = {k: unliteral(v) for k, v in kws.items()}
        return original(self, args, kws)

    get_call_template._netdam_unliteral = True  # type: ignore[attr-defined]  # a marker attribute on a function object
    setattr(dispatcher.Dispatcher, "get_call_template", get_call_template)  # noqa: B010 (a method, replaced)


class TypedEntry:
    """A kernel called with arguments of the same types every time: the first call goes through
    numba's dispatcher (which types them, and compiles or loads that signature), later ones
    straight to the compiled entry point, skipping the typing (~0.4 us an argument, every
    call; serve.NicLoop does the same for its loop). The owner answers for the types staying the same."""

    def __init__(self, kernel: Any) -> None:
        self.kernel = kernel
        self.entry: Callable[..., Any] | None = None

    def __call__(self, *args: Any) -> Any:
        if self.entry is not None:
            return self.entry(*args)
        result = self.kernel(*args)
        self.entry = self.kernel.overloads[tuple(typeof(a) for a in args)].entry_point
        return result
