"""PyTorch profiler summaries found in a job's log: `prof.key_averages().table()` as data.

Owns reading the table torch prints (torch/autograd/profiler_util.py `_build_table`): a
dashed line whose runs of `-` (two spaces apart) give the column widths, the header, a
dashed line, the rows, the same dashed line, then the totals ("Self CPU time total:
87.347ms"). Columns are cut by those widths, not by whitespace, since names hold spaces;
a cell wider than its column (torch's 12-wide "CUDA time avg" header) pushes the rest
along, and that shift is followed. A table is recognised by its header: "Name" first and
"# of Calls" among the columns (torch always prints both).

Input is the log's lines with their rank, ranks interleaved; each rank is read on its own.
Other output between tables is passed over; a table broken by it (a foreign line among its
rows, a header that does not fit) is dropped and reading goes on. Work is bounded: lines
over `MAX_LINE` characters are ignored, a table keeps its first `MAX_ROWS` rows, a rank its
last `MAX_TABLES` tables. Rows that only continue a stack trace (`with_stack=True`) are
dropped: a row keeps its first source line. Nothing here raises on any text. Reads no
models: a caller passes the lines in and renders `templates/console/_key_averages.html`.
"""

from __future__ import annotations

import math
import re
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field

MAX_LINE = 4096
MAX_ROWS = 500
MAX_TABLES = 20
MAX_TOTALS = 8
MAX_COLUMNS = 32
SPACING = "  "

# Columns that hold words, never a number (a name may look like one: "1").
TEXT_COLUMNS = frozenset({"Name", "Overload Name", "Input Shapes", "Source Location"})

_DASHES = re.compile(r"-+(?:  -+)+")
_TOTAL = re.compile(r"Self \S+ time total: \S+")
_NUMBER = r"(-?\d+(?:\.\d+)?)"
_TIME = re.compile(_NUMBER + r"(ns|us|ms|s)")
_PERCENT = re.compile(_NUMBER + "%")
_MEMORY = re.compile(_NUMBER + r" ([kmgtp]?)b", re.IGNORECASE)
_PLAIN = re.compile(_NUMBER)
_MICROSECONDS = {"ns": 0.001, "us": 1.0, "ms": 1e3, "s": 1e6}
_POWERS = {"": 0, "k": 1, "m": 2, "g": 3, "t": 4, "p": 5}


@dataclass(frozen=True)
class Cell:
    text: str
    value: float | None  # microseconds, percent, bytes or a count; None for words


@dataclass(frozen=True)
class KeyAverages:
    rank: int
    columns: list[str]
    rows: list[list[Cell]]
    totals: list[str]


def parse_tables(lines: Iterable[tuple[int, str]]) -> list[KeyAverages]:
    """Every rank's tables, by rank, then in the order they were printed."""
    readers: dict[int, _Reader] = {}
    for item in lines:
        if not (isinstance(item, tuple) and len(item) == 2):
            continue
        rank, text = item
        if type(rank) is not int or not isinstance(text, str) or len(text) > MAX_LINE:
            continue
        readers.setdefault(rank, _Reader(rank)).feed(text.rstrip("\r\n"))
    tables: list[KeyAverages] = []
    for rank in sorted(readers):
        tables.extend(readers[rank].finish())
    return tables


def cell_value(column: str, text: str) -> float | None:
    """The number a cell holds, in the unit it sorts by (see `Cell`), if it holds one."""
    if column in TEXT_COLUMNS:
        return None
    if match := _TIME.fullmatch(text):
        value = float(match[1]) * _MICROSECONDS[match[2]]
    elif match := _PERCENT.fullmatch(text):
        value = float(match[1])
    elif match := _MEMORY.fullmatch(text):
        value = float(match[1]) * 1024 ** _POWERS[match[2].lower()]
    elif match := _PLAIN.fullmatch(text):
        value = float(match[1])
    else:
        return None
    return value if math.isfinite(value) else None


def _widths(line: str) -> tuple[int, ...] | None:
    """The column widths a dashed line gives, or None for any other line."""
    line = line.rstrip(" ")
    if not _DASHES.fullmatch(line):
        return None
    widths = tuple(len(run) for run in line.split(SPACING))
    return widths if 2 <= len(widths) <= MAX_COLUMNS else None  # PyTorch prints ~7 to 16


def _cut(line: str, widths: tuple[int, ...]) -> list[str] | None:
    """The line's cells, or None where text is left over after the last column."""
    cells: list[str] = []
    start = 0
    for width in widths:
        end = start + width
        if line[end : end + len(SPACING)].strip():  # wider than its column: find its end
            found = line.find(SPACING, end)
            end = len(line) if found < 0 else found
        cells.append(line[start:end].strip())
        start = end + len(SPACING)
    return None if line[start:].strip() else cells


def _is_row(columns: list[str], cells: list[str]) -> bool:
    """A row of numbers with a call count, or a blank or stack-continuing one (no name)."""
    for column, text in zip(columns, cells, strict=True):
        if column not in TEXT_COLUMNS and text not in ("", "--"):
            if cell_value(column, text) is None:
                return False
    if not cells[0]:
        return not any(cells[1:-1])
    return bool(cells[columns.index("# of Calls")])


@dataclass
class _Table:
    widths: tuple[int, ...]
    stage: str = "header"  # then "under" (the header's dashed line), "rows", "totals"
    columns: list[str] = field(default_factory=list)
    rows: list[list[Cell]] = field(default_factory=list)
    totals: list[str] = field(default_factory=list)


class _Reader:
    """One rank's lines in order; a table is kept once its totals have ended."""

    def __init__(self, rank: int) -> None:
        self.rank = rank
        self.tables: deque[KeyAverages] = deque(maxlen=MAX_TABLES)
        self.table: _Table | None = None

    def feed(self, line: str) -> None:
        table = self.table
        if table is None:
            self._start(line)
        elif table.stage == "header":
            self._header(table, line)
        elif table.stage == "under":
            self._under(table, line)
        elif table.stage == "rows":
            self._row(table, line)
        else:
            self._total(table, line)

    def finish(self) -> list[KeyAverages]:
        if self.table is not None and self.table.stage == "totals":
            self._keep(self.table)
        self.table = None
        return list(self.tables)

    def _start(self, line: str) -> None:
        widths = _widths(line)
        self.table = _Table(widths) if widths else None

    def _header(self, table: _Table, line: str) -> None:
        columns = _cut(line, table.widths)
        if not columns or columns[0] != "Name" or "# of Calls" not in columns:
            return self._start(line)
        table.columns = columns
        table.stage = "under"

    def _under(self, table: _Table, line: str) -> None:
        if _widths(line) != table.widths:
            return self._start(line)
        table.stage = "rows"

    def _row(self, table: _Table, line: str) -> None:
        if _widths(line) == table.widths:
            table.stage = "totals"
            return
        cells = _cut(line, table.widths)
        if cells is None or not _is_row(table.columns, cells):
            return self._start(line)  # not torch's: this table is broken, drop it
        if cells[0] and len(table.rows) < MAX_ROWS:
            row = [
                Cell(text, cell_value(column, text))
                for column, text in zip(table.columns, cells, strict=True)
            ]
            table.rows.append(row)

    def _total(self, table: _Table, line: str) -> None:
        text = line.strip()
        if _TOTAL.fullmatch(text) and len(table.totals) < MAX_TOTALS:
            table.totals.append(text)
            return
        self._keep(table)
        self._start(line)

    def _keep(self, table: _Table) -> None:
        self.tables.append(KeyAverages(self.rank, table.columns, table.rows, table.totals))
