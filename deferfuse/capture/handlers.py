"""Whether the user's code would catch an error raised here: the exception tables of its frames.

Deferring an op that can raise on values (an index out of range, a loss target out of bounds, an
integer division by zero) moves its error from the op's line to the flush that computes it.  A
program that handles the error (``try: emb = table(ids) except IndexError: emb = None``) then
never reaches its ``except`` at the op, and meets the error later, uncaught.  So such an op,
recorded where a handler in the user's frames would catch its error, runs at once instead
(capture/recorder.py).

CPython 3.11 keeps, per code object, an exception table: the bytecode ranges each handler
covers and where the handler starts (``dis.Bytecode(code).exception_entries``).  A frame's
current instruction (``f_lasti``, a byte offset: the call that is running) is covered by the
entries whose range holds it; what the handler at the entry's target does says what it is:

- ``PUSH_EXC_INFO, WITH_EXCEPT_START``: a ``with`` statement's exit, not a handler (a context
  manager that suppresses errors is not seen: ``contextlib.suppress`` is rare around ops);
- ``PUSH_EXC_INFO, POP_TOP``: a bare ``except:``, which catches everything;
- ``PUSH_EXC_INFO`` then ``CHECK_EXC_MATCH`` (one per ``except X`` clause, the next clause
  where ``POP_JUMP_FORWARD_IF_FALSE`` goes): typed clauses, whose types are the loads before
  each ``CHECK_EXC_MATCH`` (globals, builtins, locals, attributes, tuples), evaluated in the
  frame when asked, since a name's binding may change;
- anything else (a ``finally``, the cleanup of a handler's own body): no handler.

Only the user's frames count (not deferfuse's, torch's, JAX's: torch's own handlers re-raise).
A type that cannot be evaluated counts as catching: running an op at once is never wrong.
"""

from __future__ import annotations

import dis
from typing import Any, Optional

from ..debugging.source import is_internal

# The load instructions a clause's type expression is made of
_LOADS = frozenset({"LOAD_GLOBAL", "LOAD_NAME", "LOAD_FAST", "LOAD_DEREF", "LOAD_CLASSDEREF",
                    "LOAD_ATTR", "LOAD_METHOD", "BUILD_TUPLE", "LOAD_CONST"})
_CATCH_ALL = "catch all"
_MAX_SCAN = 400          # instructions a handler's clauses are looked for in
_CACHE_LIMIT = 1 << 14

# code object -> [(start, end, clauses)] for the handlers that catch: clauses is _CATCH_ALL or a
# list of each clause's load instructions
_HANDLERS: dict[Any, list] = {}


def _clauses(instructions: list, by_offset: dict, target: int) -> Optional[Any]:
    """What the handler at ``target`` catches: _CATCH_ALL, a list of clauses, or None (not a
    handler: a with statement's exit, a finally, a cleanup)."""
    i = by_offset.get(target)
    if i is None or instructions[i].opname != "PUSH_EXC_INFO" or i + 1 >= len(instructions):
        return None
    first = instructions[i + 1].opname
    if first == "POP_TOP":
        return _CATCH_ALL
    if first == "WITH_EXCEPT_START":
        return None
    clauses: list = []
    loads: list = []
    j = i + 1
    for _ in range(_MAX_SCAN):
        if j >= len(instructions):
            break
        ins = instructions[j]
        name = ins.opname
        if name == "CHECK_EXC_MATCH":
            clauses.append(tuple(loads))
            loads = []
            following = instructions[j + 1] if j + 1 < len(instructions) else None
            if following is not None and following.opname.startswith("POP_JUMP") and following.argval in by_offset:
                j = by_offset[following.argval]   # (the next clause, past this one's body)
                continue
            break
        if name == "CHECK_EG_MATCH":   # (except*: catching, as far as we can say)
            return _CATCH_ALL
        if name == "RERAISE":
            break
        if name in _LOADS:
            loads.append((name, ins.argval, ins.arg))
        elif name not in ("NOP", "CACHE", "PUSH_NULL", "PRECALL"):
            loads = []
        j += 1
    return clauses or None


def _handlers(code: Any) -> list:
    found = _HANDLERS.get(code)
    if found is None:
        found = []
        try:
            bytecode = dis.Bytecode(code)
            entries = bytecode.exception_entries
        except (AttributeError, TypeError):   # (a Python without exception tables)
            entries = []
        if entries:
            instructions = list(bytecode)
            by_offset = {ins.offset: k for k, ins in enumerate(instructions)}
            for entry in entries:
                clauses = _clauses(instructions, by_offset, entry.target)
                if clauses is not None:
                    found.append((entry.start, entry.end, clauses))
        if len(_HANDLERS) >= _CACHE_LIMIT:
            _HANDLERS.clear()
        _HANDLERS[code] = found
    return found


def _evaluate(loads: tuple, frame: Any) -> Any:
    """The value of a clause's type expression in ``frame`` (raises if it cannot be had)."""
    stack: list = []
    for name, value, arg in loads:
        if name == "LOAD_GLOBAL":
            stack.append(frame.f_globals[value] if value in frame.f_globals else frame.f_builtins[value])
        elif name == "LOAD_NAME":
            for scope in (frame.f_locals, frame.f_globals, frame.f_builtins):
                if value in scope:
                    stack.append(scope[value])
                    break
            else:
                raise KeyError(value)
        elif name in ("LOAD_FAST", "LOAD_DEREF", "LOAD_CLASSDEREF"):
            stack.append(frame.f_locals[value])
        elif name in ("LOAD_ATTR", "LOAD_METHOD"):
            stack.append(getattr(stack.pop(), value))
        elif name == "LOAD_CONST":
            stack.append(value)
        else:   # BUILD_TUPLE
            count = arg or 0
            items = tuple(stack[len(stack) - count:]) if count else ()
            del stack[len(stack) - count:]
            stack.append(items)
    return stack[-1]


def _catches(clauses: Any, frame: Any, errors: tuple) -> bool:
    if clauses is _CATCH_ALL:
        return True
    for loads in clauses:
        try:
            caught = _evaluate(loads, frame)
        except Exception:  # noqa: BLE001 - what cannot be evaluated counts as catching
            return True
        types = caught if isinstance(caught, tuple) else (caught,)
        for t in types:
            if not isinstance(t, type) or any(issubclass(e, t) for e in errors):
                return True
    return False


def scope_of(frame: Any) -> Optional[tuple]:
    """Where a defer scope starts: the user's frame that entered it (a ``with`` block's, the
    caller of ``set_mode``) as (its id, its code, its instruction then).  Handlers around that
    instruction enclose the whole scope: every flush of it happens inside them, so they catch a
    late error all the same and need nothing run at once (pytest's own handler around a test,
    IPython's around a cell, a script's ``try: main()``)."""
    while frame is not None and is_internal(frame.f_code):
        frame = frame.f_back
    return None if frame is None else (id(frame), frame.f_code, frame.f_lasti)


def catches(frame: Any, errors: tuple, scope: Optional[tuple] = None) -> bool:
    """Whether a handler in the user's frames, from ``frame`` outwards, would catch an error of
    one of the types ``errors`` raised at the frame's current instruction, before the error
    leaves the defer scope ``scope`` (``scope_of``; None: anywhere)."""
    while frame is not None:
        code = frame.f_code
        at_scope = scope is not None and id(frame) == scope[0] and code is scope[1]
        if not is_internal(code):
            handlers = _handlers(code)
            if handlers:
                lasti = frame.f_lasti
                for start, end, clauses in handlers:
                    if start <= lasti < end and not (at_scope and start <= scope[2] < end) \
                            and _catches(clauses, frame, errors):
                        return True
        if at_scope:
            return False
        frame = frame.f_back
    return False
