"""Snapshot the interval's raw records and version them in the DVC data registry.

Reads the ``date=YYYY-MM-DD`` partitions of the look-back window ending before ``--end-date``,
normalizes the texts (NFC, control characters stripped, ``\\n`` line ends), drops exact
duplicates by content hash, writes ``snapshot.jsonl`` + ``stats.json`` to ``--output`` and tags
the snapshot in the DVC registry by what it holds: ``data-<end date>-<N>d-<content hash, 12>``
(the window and the content), so two snapshots of one date with other look-backs or other raw
data get two tags instead of a conflict. Re-running a window gives the same content hash and
reuses the tag. ``--restore TAG`` instead writes the snapshot of an existing data version, checked
against its tag (a replay reads exactly what the model was trained on).

A retrain the drift check started (``--trigger``) must have something new to learn: raw
partitions from the champion's data end on, and/or (``snapshot.learn_from_traffic``) a sample of
the captured prompts that check read, appended after the window's documents (:func:`traffic_sample`).
"""

from __future__ import annotations

import argparse
import datetime as dt
import hashlib
import json
import os
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from tasks.config import REPO_ROOT, SnapshotSettings
from tasks.lib import records, storage
from tasks.lib.dvc_registry import DataVersion, Registry
from tasks.lib.errors import StepError
from tasks.lib.params import load_settings
from tasks.lib.step import Progress, log, run_step, step_parser
from tasks.results import DataVersionResult, SnapshotResult

RUN_ID_FILE = "_RUN_ID"  # in the DAG run's storage folder: the run id it belongs to


@dataclass(frozen=True)
class TrafficSample:
    """The captured prompts a drift-started retrain may learn from, as raw records, and what
    became of the others of the window."""

    drift_report: str
    records: tuple[dict[str, Any], ...]
    prompts: int  # distinct prompts of the window
    held_out: int  # in the gate's slice (drift.heldout_fraction), or one of its prompts once cleaned: never trained on
    dropped_length: int
    dropped_text: int


def readable(text: str) -> bool:
    """Text worth learning: no broken characters, and letters for at least half of what is not space."""
    if "\ufffd" in text or records.CONTROL_CHARS_RE.search(text):
        return False
    visible = [c for c in text if not c.isspace()]
    return sum(c.isalpha() for c in visible) >= len(visible) / 2


def traffic_sample(drift_report: str, params: SnapshotSettings, heldout_fraction: float) -> TrafficSample:
    """The distinct captured prompts of the window the drift check read (its report.json), less
    the held-out slice, scrubbed of personal data again (the capture scrubbed them when it wrote
    them), normalized, within the length bounds and readable, in the order of their hash."""
    from tasks.drift import checked_prompts, held_out

    def clean(text: str) -> str:
        return records.normalize_text(records.scrub(text))

    texts, end = checked_prompts(drift_report)
    slice_of = {t: held_out(t, heldout_fraction) for t in texts}
    # a prompt that reads as a held-out one once cleaned (other personal data, other spaces) is
    # that prompt: not trained on either
    judged = {clean(t) for t in texts if slice_of[t]}
    cleaned = [c for c in (clean(t) for t in texts if not slice_of[t]) if c not in judged]
    fitting = [t for t in cleaned if params.traffic_min_chars <= len(t) <= params.traffic_max_chars]
    kept = sorted((t for t in fitting if readable(t)), key=records.content_hash)
    rows = tuple({"id": f"traffic-{records.content_hash(t)[:16]}", "text": t, "source": f"traffic:{drift_report}",
                  "created_at": end.isoformat()} for t in kept)
    return TrafficSample(drift_report, rows, prompts=len(texts), held_out=len(texts) - len(cleaned),
                         dropped_length=len(cleaned) - len(fitting), dropped_text=len(fitting) - len(kept))


def collect(source: str, days: list[dt.date], max_record_bytes: int, workdir: Path,
            traffic: tuple[tuple[dict[str, Any], ...], float] = ((), 0.0)
            ) -> tuple[records.DedupResult, dict[str, Any], dict[str, int]]:
    """The window's records, de-duplicated, and per partition (day): its files, its records and
    how many of them repeat a text seen before in the window (validation judges each day too).
    ``traffic`` (records, most share of the text bytes) come after the documents: one that
    repeats a document is dropped, and they stop at their share (counted apart from the days)."""
    files = records.partition_files(source, days)
    if not files:
        raise StepError(f"{source}: no partitions with data for {days[0]}..{days[-1]} (empty interval)")
    progress = Progress("snapshot read", len(files), "files")
    partitions = {day.isoformat(): {"files": 0, "records": 0, "repeated": 0} for day in days}
    sampled = {"records": 0, "repeated": 0, "capped": 0, "bytes": 0}
    kept_bytes = {"documents": 0, "traffic": 0}  # of the records kept (not repeats)
    current: dict[str, int] = {}  # the counts of the partition being read (or of the traffic)
    size, kind = 0, "documents"  # of the record just yielded

    def all_records() -> Iterator[dict[str, Any]]:
        nonlocal current, size, kind
        for day, uri in files:
            current = partitions[day.isoformat()]
            current["files"] += 1
            for record in records.parse_lines(uri, storage.read_bytes(uri), max_record_bytes):
                size = len(record["text"].encode("utf-8"))
                yield record
            progress.update(1)
        current, kind = sampled, "traffic"
        rows, share = traffic
        budget = share / (1 - share) * kept_bytes["documents"]  # traffic / (documents + traffic) <= share
        for row in rows:
            size = len(row["text"].encode("utf-8"))
            if kept_bytes["traffic"] + size > budget:
                sampled["capped"] += 1
                continue
            yield row

    def count(repeated: bool) -> None:  # called right after each record the generator yields
        current["records"] += 1
        current["repeated"] += repeated
        if not repeated:
            kept_bytes[kind] += size

    result = records.normalize_and_dedup(all_records(), count, workdir)
    sampled["bytes"] = kept_bytes["traffic"]
    if not result.count:
        raise StepError(f"{source}: the interval {days[0]}..{days[-1]} holds no records (empty interval)")
    return result, partitions, sampled


def write_snapshot(result: records.DedupResult, out_dir: Path) -> dict[str, Any]:
    path = out_dir / "snapshot.jsonl"
    digest = hashlib.sha256()
    offsets = np.zeros(result.count + 1, dtype=np.int64)  # record i: bytes offsets[i]:offsets[i+1]
    with path.open("wb") as fh:
        for index, record in enumerate(result):  # streamed from the spill: never all in memory
            line = (json.dumps(record, ensure_ascii=False, sort_keys=True) + "\n").encode("utf-8")
            digest.update(line)
            fh.write(line)
            offsets[index + 1] = offsets[index] + len(line)
    # lets each tokenize shard read only its own byte range
    np.save(out_dir / "snapshot.offsets.npy", offsets)
    return {
        "content_hash": digest.hexdigest(),
        "records": result.count,
        "records_in": result.records_in,
        "duplicates_removed": result.records_in - result.count,
        "bytes": path.stat().st_size,
    }


def data_tag(prefix: str, end: dt.date, days: int, content_hash: str) -> str:
    """What was snapshotted, as a git tag: the window (end date, days) and the content."""
    return f"{prefix}{end.isoformat()}-{days}d-{content_hash[:12]}"


def registry_dir(configured: str) -> Path:
    """``DVC_REGISTRY_DIR``, else ``snapshot.registry_dir`` under the checkout where that is
    writable, else under the temp folder: in a pod the image's root filesystem is read-only and
    the registry is a clone of its git remote anyway."""
    if os.environ.get("DVC_REGISTRY_DIR"):
        return Path(os.environ["DVC_REGISTRY_DIR"])
    local = REPO_ROOT / configured
    probe = local if local.exists() else REPO_ROOT
    if os.access(probe, os.W_OK) and not _read_only_mount(probe):
        return local
    return Path(tempfile.gettempdir()) / "dvc-registry"


def _read_only_mount(path: Path) -> bool:
    return bool(os.statvfs(path).f_flag & os.ST_RDONLY)


def registry(params: SnapshotSettings) -> Registry:
    path = registry_dir(params.registry_dir)
    git_remote = os.environ.get("DVC_REGISTRY_GIT_REMOTE", params.registry_git_remote)
    return Registry(path, params.registry_remote, git_remote)


def claim_run_folder(output: str, run_id: str) -> None:
    """The DAG run's folder (the output's parent) is ``run_id``'s. Storage keys replace ':' and
    '+' (S3 clients mangle them), so two run ids can share one folder (``manual__...T10:00:00+00:00``
    and ``manual__...T10-00-00_00-00``), and the second run would read and overwrite the first's
    outputs. The run's first step claims the folder with a marker; a run of another id is refused
    before it writes anything, a retry of the same run passes."""
    marker = storage.sibling(output, RUN_ID_FILE)
    if not storage.exists(marker):
        storage.write_bytes(marker, run_id.encode())
        return
    owner = storage.read_bytes(marker).decode(errors="replace")
    if owner != run_id:
        raise StepError(f"--run-id {run_id!r}: its storage folder {marker.rsplit('/', 1)[0]} belongs to run "
                        f"{owner!r} (the two ids share one storage key): trigger this run with another run id")


def index_snapshot(path: Path) -> tuple[str, int, np.ndarray]:
    """A snapshot file's content hash, record count and record offsets (as write_snapshot made them)."""
    digest, offsets = hashlib.sha256(), [0]
    with path.open("rb") as fh:
        for line in fh:
            digest.update(line)
            offsets.append(offsets[-1] + len(line))
    return digest.hexdigest(), len(offsets) - 1, np.asarray(offsets, dtype=np.int64)


def restore(args: argparse.Namespace, params: SnapshotSettings) -> SnapshotResult:
    """The snapshot of an existing data version (a replay), byte for byte, as the step wrote it."""
    with storage.staged_output(args.output) as out_dir:
        path = out_dir / "snapshot.jsonl"
        version, stats = registry(params).restore(args.restore, path)
        content_hash, count, offsets = index_snapshot(path)
        if content_hash != version.content_hash or count != version.records:
            raise StepError(f"data version {args.restore}: the DVC remote returned {count} records of content "
                            f"{content_hash[:12]}, the tag records {version.records} of {version.content_hash[:12]}")
        np.save(out_dir / "snapshot.offsets.npy", offsets)
        (out_dir / "stats.json").write_text(json.dumps({**stats, "commit": version.commit}, indent=1, sort_keys=True))
    log.info("restored data version %s: %d records, content %s", version.tag, count, content_hash[:12])
    traffic: dict[str, Any] = stats.get("traffic") or {}  # type: ignore[assignment]
    return snapshot_result(args.output, version, int(stats.get("duplicates_removed", 0)),  # type: ignore[call-overload]
                           int(traffic.get("trained", 0)))


def snapshot_result(output: str, version: DataVersion, duplicates_removed: int,
                    traffic_records: int = 0) -> SnapshotResult:
    return SnapshotResult(
        snapshot_uri=storage.join(output, "snapshot.jsonl"),
        stats_uri=storage.join(output, "stats.json"),
        data_version=DataVersionResult(tag=version.tag, content_hash=version.content_hash, records=version.records,
                                       bytes=version.bytes, commit=version.commit, new=version.created),
        duplicates_removed=duplicates_removed,
        traffic_records=traffic_records,
    )


def traffic_stats(traffic: TrafficSample, sampled: dict[str, int]) -> dict[str, Any]:
    """What the snapshot took of the captured prompts (stats.json, and so the data version)."""
    return {"drift_report": traffic.drift_report, "prompts": traffic.prompts, "held_out": traffic.held_out,
            "dropped_length": traffic.dropped_length, "dropped_text": traffic.dropped_text,
            "duplicates": sampled["repeated"], "capped": sampled["capped"],
            "trained": sampled["records"] - sampled["repeated"], "bytes": sampled["bytes"]}


def traffic_line(stats: dict[str, Any]) -> str:
    return (f"{stats['trained']} of {stats['prompts']} distinct prompts trained on ({stats['bytes']:,} bytes); "
            f"{stats['held_out']} held out for the gate, {stats['dropped_length']} too short or long, "
            f"{stats['dropped_text']} not readable text, {stats['duplicates']} repeating a document, "
            f"{stats['capped']} past the share")


def nothing_new(trigger: dict[str, Any], source: str, end: str, traffic: TrafficSample | None) -> StepError:
    why = ("captured traffic is not training data (snapshot.learn_from_traffic)" if traffic is None else
           "the captured prompts left none to learn from (held out, too short or long, not text, repeating a "
           "document, or past snapshot.traffic_max_share)")
    return StepError(f"--trigger: this retrain was started by the drift check ({trigger['drift_report']}), but "
                     f"{source} holds no partition from {end} on, after champion v{trigger['champion']}'s data, and "
                     f"{why}: nothing new to learn from (land data of the drifted domain, e.g. make import, then "
                     "retrain)")


def check_a_drift_retrain_has_new_data(trigger: dict[str, Any], source: str, days: list[dt.date],
                                       model_name: str, traffic: TrafficSample | None) -> str | None:
    """A retrain the drift check started (``trigger``: its raw data Asset event's extra) must learn
    what the champion did not: raw partitions of the window from the day the champion's data ended
    on, or captured prompts of the check's window (``traffic``, where snapshot.learn_from_traffic
    allows it). Without either, it would train on the data the champion saw and serve the drifted
    traffic no better: refused with one line, before anything is written. The champion's data end
    when the captured prompts are all it has that is new (the snapshot then checks that some are
    kept: :func:`nothing_new`); None otherwise. A run something else started, or a champion
    without a data window, passes."""
    if not trigger.get("drift_report") or not trigger.get("champion"):
        return None
    from tasks.lib.registry import data_end

    end = data_end(model_name, str(trigger["champion"]))
    if end is None:
        return None
    newer = [day for day in days if day >= dt.date.fromisoformat(end)]
    if newer and records.partition_files(source, newer):
        return None
    if traffic is not None and traffic.records:
        return end
    raise nothing_new(trigger, source, end, traffic)


def main(args: argparse.Namespace) -> SnapshotResult:
    if args.run_id:
        claim_run_folder(args.output, args.run_id)
    settings = load_settings("snapshot", args.overrides)
    if args.restore:
        return restore(args, settings.snapshot)
    if not args.source or not args.end_date:
        raise StepError("--source and --end-date are required (or --restore TAG)")
    params = settings.snapshot
    end = dt.date.fromisoformat(args.end_date)
    logical = dt.date.fromisoformat(args.logical_date) if args.logical_date else end
    days = records.interval_days(end, args.lookback_days or settings.pipeline.lookback_days)
    from tasks.drift import started_by

    trigger = started_by(args.trigger)
    traffic = (traffic_sample(trigger["drift_report"], params, settings.drift.heldout_fraction)
               if trigger and params.learn_from_traffic else None)
    only_traffic = check_a_drift_retrain_has_new_data(trigger, args.source, days, settings.pipeline.model_name, traffic)
    log.info("snapshot of %s for %s..%s", args.source, days[0], days[-1])
    with storage.scratch() as scratch, storage.staged_output(args.output) as out_dir:
        rows = traffic.records if traffic else ()
        result, partitions, sampled = collect(args.source, days, params.max_record_bytes, scratch / "dedup",
                                              (rows, params.traffic_max_share))
        if only_traffic and sampled["records"] == sampled["repeated"]:
            raise nothing_new(trigger, args.source, only_traffic, traffic)  # nothing committed
        stats = write_snapshot(result, out_dir)
        tag = data_tag(params.tag_prefix, logical, len(days), stats["content_hash"])
        stats.update(source=args.source, days=[d.isoformat() for d in days], tag=tag, partitions=partitions)
        if traffic is not None:
            stats["traffic"] = traffic_stats(traffic, sampled)
            log.info("captured traffic of %s: %s", traffic.drift_report, traffic_line(stats["traffic"]))
        version = registry(params).commit_snapshot(tag, out_dir / "snapshot.jsonl", stats)
        stats["commit"] = version.commit
        (out_dir / "stats.json").write_text(json.dumps(stats, indent=1, sort_keys=True))
    log.info(
        "snapshot %s: %d records (%d duplicates removed), %.1f MB, content %s",
        tag, stats["records"], stats["duplicates_removed"], stats["bytes"] / 1e6, stats["content_hash"][:12],
    )
    return snapshot_result(args.output, version, stats["duplicates_removed"],
                           stats["traffic"]["trained"] if traffic else 0)


def parser() -> argparse.ArgumentParser:
    p = step_parser("snapshot", __doc__.splitlines()[0])
    p.add_argument("--source", help="raw data URI holding date=YYYY-MM-DD/*.jsonl partitions")
    p.add_argument("--end-date", help="end of the interval, exclusive (YYYY-MM-DD)")
    p.add_argument("--restore", metavar="TAG", help="instead: the snapshot of this existing data version (a replay)")
    p.add_argument("--logical-date", help="date that names the data version (default: --end-date)")
    p.add_argument("--lookback-days", type=int, help="days before --end-date to read (default: params)")
    p.add_argument("--output", required=True, help="run-scoped output URI")
    p.add_argument("--run-id", help="the DAG run's id: claims the run's storage folder (see claim_run_folder)")
    p.add_argument("--trigger", help="the drift check's Asset event extra (JSON) when it started this run, or "
                                     "{\"drift_report\": URI}: the window must hold data newer than the champion's")
    return p


if __name__ == "__main__":
    run_step(parser(), main)
