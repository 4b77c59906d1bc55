"""Connection arguments of Airflow's metadata database on the local stack (SQLite).

SQLite takes one writer at a time and Python's driver gives up after 5 s waiting for the
lock. With the scheduler, dag-processor, api-server and triggerer writing beside a CLI call
(`airflow backfill create`) while runs train on a 2-core machine, 5 s is not enough: the CLI
failed with "database is locked". airflow.cfg points `[database] sql_alchemy_connect_args`
here (the plugins folder is on Airflow's sys.path before it opens the database). A cluster's
PostgreSQL config does not use these.

No wait helps a transaction that read, then writes after another process committed (its WAL
snapshot is stale: SQLite raises at once). `backfill create` does so inside a SAVEPOINT;
Airflow removes the half-made backfill on that error, and docs/operations.md says to rerun it.
"""

from __future__ import annotations

from typing import Any

# seconds a connection waits for SQLite's write lock before raising "database is locked"
LOCK_WAIT_S = 60

SQLITE_CONNECT_ARGS: dict[str, Any] = {"timeout": LOCK_WAIT_S}
SQLITE_CONNECT_ARGS_ASYNC: dict[str, Any] = {"timeout": LOCK_WAIT_S}  # aiosqlite takes the same argument
