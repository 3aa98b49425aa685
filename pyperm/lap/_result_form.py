"""A warning for code written when a list of equal-shape matrices was read as a stack.

Until 2026-11-29 (see the changelog), ``batch_linear_sum_assignment([c0, c1])`` with ``c0`` and
``c1`` of one shape was read as a ``(2, n, m)`` stack and returned ``(row_ind, col_ind)`` as two
``(2, k)`` arrays. A list now returns one ``(row_ind, col_ind)`` pair per matrix. With exactly two
matrices, the old ``rows, cols = batch_linear_sum_assignment([c0, c1])`` still runs, and then
``rows`` is problem 0's pair and ``cols`` problem 1's: wrong answers without an error. For any
other count the old unpacking raises on its own.

So, for a list or tuple of two equal-shape matrices only, :func:`warn_if_unpacked_as_stack`
reads the caller's next instructions: a result unpacked straight into two plain names is warned
about. ``(r0, c0), (r1, c1) = ...`` and every other use are left alone. The check reads
bytecode, which CPython defines; elsewhere it does nothing.
"""

from __future__ import annotations

import dis
import sys
import warnings
from types import FrameType
from typing import Any

import numpy as np

__all__ = ["ResultFormWarning", "warn_if_unpacked_as_stack"]


class ResultFormWarning(UserWarning):
    """A batch result used in the form the input had before its meaning changed.

    Raised as a warning, never an error: silence it with
    ``warnings.filterwarnings("ignore", category=pyperm.ResultFormWarning)``.
    """


_seen: dict[tuple[Any, int], bool] = {}  # (code, instruction offset) -> unpacked into two names


def _unpacks_into_two_names(frame: FrameType) -> bool:
    key = (frame.f_code, frame.f_lasti)
    found = _seen.get(key)
    if found is None:
        after = [ins for ins in dis.get_instructions(frame.f_code) if ins.offset > frame.f_lasti][:3]
        found = (len(after) == 3 and after[0].opname == "UNPACK_SEQUENCE" and after[0].arg == 2
                 and all(ins.opname.startswith("STORE_") for ins in after[1:]))
        if len(_seen) < 1024:  # call sites of a program: few; the bound keeps a generated-code loop small
            _seen[key] = found
    return found


def warn_if_unpacked_as_stack(costs: Any) -> None:
    """Warns when two equal-shape matrices' answers are about to be unpacked as one stack's.

    Called from :func:`pyperm.batch_linear_sum_assignment` itself, so the frame two levels up
    is the user's call site.
    """
    if len(costs) != 2 or sys.implementation.name != "cpython":
        return
    try:
        shapes = [tuple(getattr(c, "shape", None) or np.shape(c)) for c in costs]
        if len(shapes[0]) != 2 or shapes[0] != shapes[1]:
            return
        unpacked = _unpacks_into_two_names(sys._getframe(2))
    except Exception:  # ragged nested lists, no such frame: nothing the old code read as a stack
        return
    if unpacked:
        warnings.warn(
            "batch_linear_sum_assignment of a list of two matrices returns one (row_ind, col_ind) pair per "
            "matrix, and the result is unpacked into two names here: the first holds matrix 0's pair and the "
            "second matrix 1's, not the rows and the columns of a stack (a list of equal-shape matrices was read "
            "as a (B, n, m) stack before; see the changelog). For (B, k) arrays pass np.stack(costs); to keep "
            "the pairs, write (r0, c0), (r1, c1) = ...",
            ResultFormWarning,
            stacklevel=3,
        )
