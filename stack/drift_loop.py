"""`make drift-loop`'s data: what the retrain that answers a drift check learns from.

After the drift check found drift (``make drift-loop`` sends the drifted traffic and runs it
first), the demo generator lands the next ``NEW_DAYS`` raw partitions with ``DRIFTED_SHARE`` of
their documents in the drifted domain (``tasks.seed --drifted-share``: the Cyrillic letters the
traffic uses, on other documents), from the champion's data end on and after every partition that
exists (raw data is immutable: a partition already landed is never rewritten). The retrain's run
configuration follows, as JSON: its window (the line's ``lookback_days``) ends after the new days,
so most of it is still the old domain (the gate holds the old domain's held-out text to the
champion's), and its ``drift_report``
names the check it answers (the snapshot refuses a window with nothing newer than the champion's
data; the run checks the drift again on the same traffic once it promoted its version).
"""

from __future__ import annotations

import datetime as dt
import json
import os
import re
import subprocess
import sys
from dataclasses import dataclass

from tasks.config import Settings
from tasks.lib import storage

NEW_DAYS = 2
# of the new days' documents. A Cyrillic letter is two byte tokens where the old vocabulary merges
# ~4 letters into one: a drifted document is ~4.6x the tokens of its original, so a quarter of two
# days' documents is ~a quarter of a 7-day window's tokens (at half, 43%, and a 3-day window 70%:
# the held-out text of the old domain then regressed past the gate's 5%, 435 vs 404)
DRIFTED_SHARE = 0.25
PARTITION = re.compile(r"/date=(\d{4}-\d{2}-\d{2})/_SUCCESS$")


class NothingToAnswer(Exception):
    """No drift check found drift: a retrain would have nothing to answer."""


@dataclass(frozen=True)
class LoopData:
    """The days landed in the drifted domain, and the retrain's run configuration."""

    days: tuple[dt.date, ...]
    conf: dict[str, object]


def newest_drift(settings: Settings) -> str:
    """The newest drift check's report (its HTML's URI), which must have found drift."""
    root = storage.join(settings.pipeline.artifact_root, settings.drift.dag_id)
    newest = storage.newest_json(root, "/drift/report.json")
    if newest is None:
        raise NothingToAnswer(f"{root}: no drift check has run yet (make drift)")
    uri, report = newest
    if report.get("verdict") != "drift":
        raise NothingToAnswer(f"the newest drift check ({uri}) found {report.get('verdict')!r}: there is nothing for a "
                              "retrain to answer")
    return storage.sibling(uri, "report.html")


def landed_days(raw_data_uri: str) -> list[dt.date]:
    """The raw partitions that exist (complete: their ``_SUCCESS`` marker), oldest first."""
    found = (PARTITION.search(uri) for uri in storage.list_files(raw_data_uri))
    return sorted(dt.date.fromisoformat(m.group(1)) for m in found if m)


def new_days(landed: list[dt.date], champion_data_end: dt.date | None) -> list[dt.date]:
    """``NEW_DAYS`` days after every landed partition, from the champion's data end on."""
    first = max([d + dt.timedelta(days=1) for d in landed[-1:]] + ([champion_data_end] if champion_data_end else []))
    return [first + dt.timedelta(days=i) for i in range(NEW_DAYS)]


def land(settings: Settings, raw_data_uri: str = "", seed_options: tuple[str, ...] = ()) -> LoopData:
    """Land the drifted domain's new days (``tasks.seed`` with ``seed_options``) under
    ``raw_data_uri`` (default: the line's), and the retrain's configuration."""
    from tasks.lib.registry import CHAMPION, alias_version, data_end

    report = newest_drift(settings)
    raw = raw_data_uri or settings.pipeline.raw_data_uri
    name = settings.pipeline.model_name
    champion = alias_version(name, CHAMPION)
    end = data_end(name, champion) if champion else None
    days = new_days(landed_days(raw), dt.date.fromisoformat(end) if end else None)
    subprocess.run([sys.executable, "-m", "tasks.seed", "--output", raw, "--end-date", days[-1].isoformat(),
                    "--drifted-share", str(DRIFTED_SHARE), *seed_options],
                   check=True, env=os.environ, stdout=sys.stderr)  # stdout: the configuration only
    # the demo's drifted domain is another alphabet: the retrain may grow the vocabulary to cover it
    conf: dict[str, object] = {"end_date": (days[-1] + dt.timedelta(days=1)).isoformat(), "drift_report": report,
                               "grow_vocabulary": True}
    if raw_data_uri:
        conf["raw_data_uri"] = raw_data_uri
    return LoopData(tuple(days), conf)


def main() -> int:
    from tasks.config import load

    try:
        landed = land(load())
    except NothingToAnswer as exc:
        print(f"ERROR {exc}", file=sys.stderr)
        return 2
    print(f"landed {', '.join(d.isoformat() for d in landed.days)} with {DRIFTED_SHARE:.0%} of their documents in "
          "the drifted domain", file=sys.stderr)
    print(json.dumps(landed.conf))
    return 0
