"""The LASP-2 timing rows the programs' `--time ... --json FILE` write (one file per process, one
row per shape: W, B, T_local, H, D, every mode's slowest-rank median), gathered per shape over
processes and merged into a results file's rows by key. Shared by the families' report scripts.
"""
import json
from pathlib import Path


def key(row):
    """A row's shape: (W, B, T_local, H, D)."""
    return (row["W"], row["B"], row["T_local"], row["H"], row["D"])


def by_shape(files):
    """{key: [that shape's row of every process that measured it]} over one side's files."""
    rows = {}
    for f in files:
        doc = json.loads(Path(f).read_text())
        for r in doc["rows"] if isinstance(doc, dict) else doc:
            rows.setdefault(key(r), []).append(r)
    return rows


def replace_rows(old, new):
    """`old` without the rows whose key a row of `new` has, then `new`, sorted by key."""
    keys = {key(r) for r in new}
    return sorted([r for r in old if key(r) not in keys] + new, key=key)
