"""pyperm bench curves: one quick row, its page-fault counts and its table row."""

from pyperm.benchmarks.curves import HEADERS, measure, table_row


def test_a_row_counts_each_steps_page_faults():
    row = measure("digits-cnn", batch=4, repeat=2, clock="cpu")
    assert row["ratio"] > 0 and row["check"] <= 1e-4
    assert row["plain_faults"] is None or (row["plain_faults"] >= 0 and row["curve_faults"] >= 0)
    cells = table_row(row)
    assert len(cells) == len(HEADERS)
    assert cells[-1] == "n/a" or "," in cells[-1]
