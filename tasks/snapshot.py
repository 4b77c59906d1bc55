"""Snapshot the interval's raw records and version them in the DVC data registry.

Reads the ``date=YYYY-MM-DD`` partitions of the look-back window ending before ``--end-date``,
normalizes the texts (NFC, control characters stripped, ``\\n`` line ends), drops exact
duplicates by content hash, writes ``snapshot.jsonl`` + ``stats.json`` to ``--output`` and tags
the snapshot in the DVC registry by what it holds: ``data-<end date>-<N>d-<content hash, 12>``
(the window and the content), so two snapshots of one date with other look-backs or other raw
data get two tags instead of a conflict. Re-running a window gives the same content hash and
reuses the tag. ``--restore TAG`` instead writes the snapshot of an existing data version, checked
against its tag (a replay reads exactly what the model was trained on).
"""

from __future__ import annotations

import argparse
import datetime as dt
import hashlib
import json
import os
import tempfile
from collections.abc import Iterator
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


def collect(source: str, days: list[dt.date], max_record_bytes: int,
            workdir: Path) -> tuple[records.DedupResult, dict[str, Any]]:
    """The window's records, de-duplicated, and per partition (day): its files, its records and
    how many of them repeat a text seen before in the window (validation judges each day too)."""
    files = records.partition_files(source, days)
    if not files:
        raise StepError(f"{source}: no partitions with data for {days[0]}..{days[-1]} (empty interval)")
    progress = Progress("snapshot read", len(files), "files")
    partitions = {day.isoformat(): {"files": 0, "records": 0, "repeated": 0} for day in days}
    current: dict[str, int] = {}  # the counts of the partition being read

    def all_records() -> Iterator[dict[str, Any]]:
        nonlocal current
        for day, uri in files:
            current = partitions[day.isoformat()]
            current["files"] += 1
            yield from records.parse_lines(uri, storage.read_bytes(uri), max_record_bytes)
            progress.update(1)

    def count(repeated: bool) -> None:  # called right after each record the generator yields
        current["records"] += 1
        current["repeated"] += repeated

    result = records.normalize_and_dedup(all_records(), count, workdir)
    if not result.count:
        raise StepError(f"{source}: the interval {days[0]}..{days[-1]} holds no records (empty interval)")
    return result, partitions


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
    return snapshot_result(args.output, version, int(stats.get("duplicates_removed", 0)))  # type: ignore[call-overload]


def snapshot_result(output: str, version: DataVersion, duplicates_removed: int) -> SnapshotResult:
    return SnapshotResult(
        snapshot_uri=storage.join(output, "snapshot.jsonl"),
        stats_uri=storage.join(output, "stats.json"),
        data_version=DataVersionResult(tag=version.tag, content_hash=version.content_hash, records=version.records,
                                       bytes=version.bytes, commit=version.commit, new=version.created),
        duplicates_removed=duplicates_removed,
    )


def check_a_drift_retrain_has_new_data(trigger: dict[str, Any], source: str, days: list[dt.date],
                                       model_name: str) -> None:
    """A retrain the drift check started (``trigger``: its raw data Asset event's extra) must learn
    what the champion did not: raw partitions of the window from the day the champion's data ended
    on. Without any, it would train on the data the champion saw (captured traffic is not part of
    a retrain's data) and serve the drifted traffic no better: refused with one line, before
    anything is written. A run something else started, or a champion without a data window, passes."""
    if not trigger.get("drift_report") or not trigger.get("champion"):
        return
    from tasks.lib.registry import data_end

    champion = str(trigger["champion"])
    end = data_end(model_name, champion)
    if end is None:
        return
    newer = [day for day in days if day >= dt.date.fromisoformat(end)]
    if not newer or not records.partition_files(source, newer):
        raise StepError(f"--trigger: this retrain was started by the drift check ({trigger['drift_report']}), but "
                        f"{source} holds no partition from {end} on, after champion v{champion}'s data: nothing "
                        "new to learn from (land data of the drifted domain, e.g. make import, then retrain)")


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

    check_a_drift_retrain_has_new_data(started_by(args.trigger), args.source, days, settings.pipeline.model_name)
    log.info("snapshot of %s for %s..%s", args.source, days[0], days[-1])
    with storage.scratch() as scratch, storage.staged_output(args.output) as out_dir:
        result, partitions = collect(args.source, days, params.max_record_bytes, scratch / "dedup")
        stats = write_snapshot(result, out_dir)
        tag = data_tag(params.tag_prefix, logical, len(days), stats["content_hash"])
        stats.update(source=args.source, days=[d.isoformat() for d in days], tag=tag, partitions=partitions)
        version = registry(params).commit_snapshot(tag, out_dir / "snapshot.jsonl", stats)
        stats["commit"] = version.commit
        (out_dir / "stats.json").write_text(json.dumps(stats, indent=1, sort_keys=True))
    log.info(
        "snapshot %s: %d records (%d duplicates removed), %.1f MB, content %s",
        tag, stats["records"], stats["duplicates_removed"], stats["bytes"] / 1e6, stats["content_hash"][:12],
    )
    return snapshot_result(args.output, version, stats["duplicates_removed"])


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
