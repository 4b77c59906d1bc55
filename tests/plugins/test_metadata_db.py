"""Airflow's SQLite metadata database waits for a busy writer instead of failing: the CLI's
`backfill create` beside a running scheduler got "database is locked" after the driver's 5 s."""

from __future__ import annotations

import sqlite3
import threading
import time

import metadata_db
from sqlalchemy import text

HELD_S = 6.0  # longer than the sqlite3 driver's default wait of 5 s


def test_a_session_waits_for_another_writer_longer_than_the_driver_default(airflow_db: None) -> None:
    from airflow import settings

    database = settings.engine.url.database
    other_writer = sqlite3.connect(database, isolation_level=None, check_same_thread=False)
    other_writer.execute("BEGIN IMMEDIATE")  # holds the write lock, as a scheduler loop's transaction does
    releaser = threading.Timer(HELD_S, other_writer.rollback)
    releaser.start()
    started = time.monotonic()
    try:
        with settings.engine.begin() as conn:
            conn.execute(text("CREATE TABLE IF NOT EXISTS _lock_probe (x INTEGER)"))
            conn.execute(text("DROP TABLE _lock_probe"))
    finally:
        releaser.join()
        other_writer.close()
    assert HELD_S - 0.5 <= time.monotonic() - started < metadata_db.LOCK_WAIT_S
