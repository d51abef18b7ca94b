"""What a benchmark does with its result rows (dicts with the same keys, in order): print
them as a table, and write them as a CSV under ``experiments/results``."""

from __future__ import annotations

import csv
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

RESULTS = Path(__file__).parent / "results"


def show(rows: Sequence[Mapping[str, Any]], title: str, width: int = 160) -> None:
    """The rows as a rich table, one column per key."""
    table = Table(title=title)
    for key in rows[0]:
        table.add_column(key)
    for row in rows:
        table.add_row(*(str(v) for v in row.values()))
    Console(width=width).print(table)


def save(rows: Sequence[Mapping[str, Any]], name: str) -> Path:
    """The rows as ``experiments/results/<name>``, a header line and one line per row."""
    RESULTS.mkdir(exist_ok=True)
    out = RESULTS / name
    with out.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    return out
