"""Several API servers (`vllm serve --api-server-count N`): what one records, every one serves.

vLLM routes a request's output to the API server that took it, but an engine step's scheduler
stats (and with them our pool snapshots and the copies of aborted requests' kv_stats) to only
one of them, whichever comes first. So each API server appends what it receives to one log,
an SQLite file (WAL mode, many readers and writers across processes) in a directory the
launcher makes (`ServerContext.shared_dir`, as vLLM makes PROMETHEUS_MULTIPROC_DIR), and
replays the others' events into its own store and timelines before it answers: every API
server then holds the same records and aggregates, and `/v1/kv_stats/{id}`, `/v1/kv_stats` and
the live view answer the same from any of them.

Events are ordered by the log's sequence number. A finished request is one event per engine
request id (the first writer wins, so a request whose output reaches one API server while its
copy reaches another is counted once, and only its writer counts it in the Prometheus series,
which prometheus_client then sums across processes as vLLM's own). A stop string ends a request
in its API server while its stats come with a later engine step, perhaps to another: the
finish reason it owes waits in `owed` for whichever API server records them.
"""

from __future__ import annotations

import json
import os
import sqlite3
import threading
from typing import Any, Iterator

KEEP_EVENTS = 100_000  # events kept in the log; an API server replays within seconds
PRUNE_EVERY = 1_000
OWED_LIMIT = 4096  # requests whose end an API server saw before their stats (each list)

_SCHEMA = """
CREATE TABLE IF NOT EXISTS events (
    seq INTEGER PRIMARY KEY AUTOINCREMENT,
    engine_id TEXT UNIQUE,   -- a finished request's (NULL for a pool snapshot)
    engine INTEGER NOT NULL, -- the engine core (data-parallel rank)
    body TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS owed (
    engine_id TEXT PRIMARY KEY, external_id TEXT, finish_reason TEXT, stop_reason TEXT);
"""


class SharedLog:
    """One API server's handle on the log (a connection per thread: sqlite3's rule)."""

    def __init__(self, directory: str) -> None:
        self.path = os.path.join(directory, "kv_stats.sqlite")
        self.cursor = 0  # the last sequence number replayed here
        self._local = threading.local()
        self._appended = 0
        with self._db() as db:
            db.executescript(_SCHEMA)

    def _db(self) -> sqlite3.Connection:
        db = getattr(self._local, "db", None)
        if db is None:
            db = sqlite3.connect(self.path, timeout=30.0, isolation_level=None)
            db.execute("PRAGMA journal_mode=WAL")
            db.execute("PRAGMA synchronous=NORMAL")  # a crash may lose the last events only
            self._local.db = db
        return db

    def append_finished(self, engine_id: str, engine: int, stats: dict[str, Any]) -> bool:
        """False when another API server recorded this engine request first."""
        return self._append(engine_id, engine, {"kind": "finished", "stats": stats})

    def append_snapshot(self, engine: int, snapshot: dict[str, Any], running: int,
                        waiting: int, usage: float | None) -> None:
        self._append(None, engine, {"kind": "snapshot", "snapshot": snapshot,
                                    "running": running, "waiting": waiting, "usage": usage})

    def _append(self, engine_id: str | None, engine: int, body: dict[str, Any]) -> bool:
        db = self._db()
        added = db.execute("INSERT OR IGNORE INTO events (engine_id, engine, body) "
                           "VALUES (?, ?, ?)", (engine_id, engine, json.dumps(body))).rowcount
        self._appended += 1
        if self._appended % PRUNE_EVERY == 0:
            db.execute("DELETE FROM events WHERE seq <= "
                       "(SELECT MAX(seq) FROM events) - ?", (KEEP_EVENTS,))
        return added == 1

    def new_events(self) -> Iterator[tuple[int, dict[str, Any]]]:
        """(engine, event) for every event after the last one replayed here, in log order."""
        rows = self._db().execute("SELECT seq, engine, body FROM events WHERE seq > ? "
                                  "ORDER BY seq", (self.cursor,)).fetchall()
        for seq, engine, body in rows:
            self.cursor = seq
            yield engine, json.loads(body)

    def owe(self, engine_id: str, external_id: str, finish_reason: str,
            stop_reason: Any) -> None:
        db = self._db()
        db.execute("INSERT OR REPLACE INTO owed VALUES (?, ?, ?, ?)",
                   (engine_id, external_id, finish_reason, json.dumps(stop_reason)))
        # (bounded as each API server's own list: stats an engine that died never sent)
        db.execute("DELETE FROM owed WHERE rowid <= (SELECT MAX(rowid) FROM owed) - ?",
                   (OWED_LIMIT,))

    def settle(self, engine_id: str) -> tuple[str, str, Any] | None:
        """The (API id, finish reason, stop reason) an API server left for this request."""
        row = self._db().execute("DELETE FROM owed WHERE engine_id = ? "
                                 "RETURNING external_id, finish_reason, stop_reason",
                                 (engine_id,)).fetchone()
        return (row[0], row[1], json.loads(row[2])) if row else None
