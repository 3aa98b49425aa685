"""The shape of a full assignment, shared by the dense and sparse solvers' tests."""

import numpy as np


def check_full_matching(shape, rows, cols):
    """``rows``/``cols`` are int64, ``min(n, m)`` long, rows strictly increasing, columns distinct,
    both within the matrix of ``shape``."""
    n, m = shape
    k = min(n, m)
    assert rows.dtype == np.int64 and cols.dtype == np.int64
    assert rows.shape == (k,) and cols.shape == (k,)
    assert np.all(np.diff(rows) > 0), "row_ind must be strictly increasing"
    assert len(np.unique(cols)) == k
    assert rows.min(initial=0) >= 0 and rows.max(initial=0) < max(n, 1)
    assert cols.min(initial=0) >= 0 and cols.max(initial=0) < max(m, 1)
