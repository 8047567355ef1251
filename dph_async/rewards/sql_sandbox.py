"""Running untrusted SQL on sqlite files: read-only, read-only statements, bounded in time and memory.

Layers, each catching what the others miss (a read-only URI alone still lets `ATTACH` create files,
even with `immutable=1`):
1. the file is opened through a `mode=ro` URI, and `PRAGMA query_only` refuses writes;
2. an authorizer allows only SELECT, reading columns, calling functions and recursive CTEs: ATTACH,
   PRAGMA, transactions, temp tables and every write are "not authorized";
3. `setlimit`: no attached databases, bounded strings/blobs (randomblob bombs), statement length,
   expression depth, compound selects;
4. `hard_heap_limit` for sqlite's own memory, and the worker process's RLIMIT_AS around everything;
5. a progress handler that interrupts the statement at the deadline (the parent process kills the
   worker if even that does not return);
6. at most one statement (the sqlite3 module refuses more) and at most `max_rows` rows fetched.
"""

from __future__ import annotations

import sqlite3
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal
from urllib.parse import quote

_ALLOWED = frozenset({sqlite3.SQLITE_SELECT, sqlite3.SQLITE_READ, sqlite3.SQLITE_FUNCTION,
                      sqlite3.SQLITE_RECURSIVE})
# Each limit is far above what a BIRD or Spider gold query needs.
_LIMITS = {
    sqlite3.SQLITE_LIMIT_ATTACHED: 0,
    sqlite3.SQLITE_LIMIT_EXPR_DEPTH: 200,
    sqlite3.SQLITE_LIMIT_COMPOUND_SELECT: 100,
    sqlite3.SQLITE_LIMIT_LIKE_PATTERN_LENGTH: 10_000,
    sqlite3.SQLITE_LIMIT_TRIGGER_DEPTH: 0,
}
# The progress handler runs every this many sqlite VM instructions.
_PROGRESS_EVERY = 1000
_OPEN_CONNECTIONS = 8

QueryStatus = Literal["ok", "rejected", "exec_error", "timeout"]


@dataclass(frozen=True)
class SqlLimits:
    max_rows: int = 100_000
    max_value_bytes: int = 1_000_000
    max_sql_chars: int = 100_000
    heap_limit_mb: int = 256


@dataclass(frozen=True)
class QueryOutcome:
    """Rows (as tuples) and the column count of a query's result, or why there are none."""

    status: QueryStatus
    rows: list[tuple] = field(default_factory=list)
    columns: int = 0
    detail: str = ""


def _authorize(action: int, arg1: str | None, arg2: str | None, db: str | None, trigger: str | None) -> int:
    return sqlite3.SQLITE_OK if action in _ALLOWED else sqlite3.SQLITE_DENY


def _decode(raw: bytes) -> str:
    # Some BIRD databases hold text that is not UTF-8; gold and prediction are decoded alike.
    return raw.decode("utf-8", errors="replace")


class SqlSandbox:
    """Read-only connections to sqlite files (a few kept open) that run one query at a time."""

    def __init__(self, limits: SqlLimits) -> None:
        self.limits = limits
        self._connections: OrderedDict[Path, sqlite3.Connection] = OrderedDict()
        self._deadline = 0.0

    def _interrupt(self) -> int:
        return 1 if time.monotonic() > self._deadline else 0

    def _connect(self, path: Path) -> sqlite3.Connection:
        conn = self._connections.get(path)
        if conn is not None:
            self._connections.move_to_end(path)
            return conn
        conn = sqlite3.connect(f"file:{quote(str(path))}?mode=ro", uri=True, isolation_level=None)
        # Pragmas first: the authorizer installed below refuses every PRAGMA, ours included.
        conn.execute(f"PRAGMA hard_heap_limit={self.limits.heap_limit_mb * 2**20}")
        conn.execute("PRAGMA query_only=ON")
        conn.execute("PRAGMA trusted_schema=OFF")
        conn.execute("PRAGMA temp_store=MEMORY")  # sorts spill into the capped heap, not temp files
        conn.text_factory = _decode
        conn.set_authorizer(_authorize)
        for limit, value in _LIMITS.items():
            conn.setlimit(limit, value)
        conn.setlimit(sqlite3.SQLITE_LIMIT_LENGTH, self.limits.max_value_bytes)
        conn.setlimit(sqlite3.SQLITE_LIMIT_SQL_LENGTH, self.limits.max_sql_chars + 1)
        conn.set_progress_handler(self._interrupt, _PROGRESS_EVERY)
        self._connections[path] = conn
        if len(self._connections) > _OPEN_CONNECTIONS:
            self._connections.popitem(last=False)[1].close()
        return conn

    def run(self, path: Path, sql: str, deadline: float) -> QueryOutcome:
        """Run one query on the database at `path`, stopping at `deadline` (a `time.monotonic()` instant)."""
        if len(sql) > self.limits.max_sql_chars:
            detail = f"query has {len(sql)} characters (limit {self.limits.max_sql_chars})"
            return QueryOutcome("rejected", detail=detail)
        self._deadline = deadline
        try:
            cursor = self._connect(path).execute(sql)
            if cursor.description is None:
                return QueryOutcome("exec_error", detail="not a query: no result columns")
            columns = len(cursor.description)
            rows: list[tuple] = []
            while batch := cursor.fetchmany(1024):
                rows.extend(batch)
                if len(rows) > self.limits.max_rows:
                    return QueryOutcome("rejected", detail=f"more than {self.limits.max_rows} rows")
            return QueryOutcome("ok", rows, columns)
        except MemoryError:
            return QueryOutcome("rejected", detail="memory limit reached")
        except sqlite3.Warning as e:  # Python 3.10's refusal of several statements
            return QueryOutcome("rejected", detail=f"Warning: {e}"[:300])
        except sqlite3.Error as e:
            return _classify(e, deadline)
        except (ValueError, UnicodeError) as e:  # NUL characters, lone surrogates
            return QueryOutcome("exec_error", detail=f"{type(e).__name__}: {e}"[:300])

    def close(self) -> None:
        for conn in self._connections.values():
            conn.close()
        self._connections.clear()


def _classify(e: sqlite3.Error, deadline: float) -> QueryOutcome:
    message = str(e)
    if message == "interrupted" and time.monotonic() >= deadline:
        return QueryOutcome("timeout", detail="query interrupted at the deadline")
    refused = (
        isinstance(e, (sqlite3.ProgrammingError, sqlite3.DataError))  # several statements; value too big
        or "not authorized" in message
        or "authorization denied" in message
        or "too many attached" in message
    )
    detail = f"{type(e).__name__}: {message}"[:300]
    return QueryOutcome("rejected" if refused else "exec_error", detail=detail)
