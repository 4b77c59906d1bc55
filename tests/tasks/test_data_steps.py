"""The data half against the real stack: SeaweedFS S3, the DVC registry, Great Expectations,
MLflow (tokenizer reuse). Each bad input ends in one clear error and nothing downstream."""

from __future__ import annotations

import datetime as dt
import hashlib
import json
import os
import shutil
import subprocess
import uuid
from pathlib import Path

import pytest
import yaml
from helpers import (
    REPO_ROOT,
    RUNTIME_PY,
    error_lines,
    params_with_model_name,
    run_measuring_peak_rss,
    run_module,
    step_result,
)

from tasks.lib import storage

pytestmark = pytest.mark.integration

GOOD = {"source": "test", "created_at": "2026-11-10T08:00:00+00:00"}


def out_uri(step: str) -> str:
    return f"s3://pipeline/tests/{uuid.uuid4().hex[:12]}/{step}"


def write_partition(source: str, day: str, body: bytes, complete: bool = True) -> None:
    """A raw partition as an ingestion job lands it: its data file, then (``complete``) its marker."""
    bucket, key = storage.split_s3(f"{source}/date={day}/part-00000.jsonl")
    storage.s3_client().put_object(Bucket=bucket, Key=key, Body=body)
    if complete:
        storage.s3_client().put_object(Bucket=bucket, Key=key.replace("part-00000.jsonl", "_SUCCESS"), Body=b"")


def snapshot(source: str, end: str, output: str, *extra: str) -> subprocess.CompletedProcess[str]:
    return run_module("tasks.snapshot", "--source", source, "--end-date", end, "--output", output, *extra)


def registry_git(*args: str) -> str:
    return subprocess.run(
        ["git", *args], cwd=os.environ["DVC_REGISTRY_DIR"], capture_output=True, text=True, check=True
    ).stdout.strip()


def test_snapshot_versions_with_dvc_and_is_idempotent(seeded_raw: str) -> None:
    first = snapshot(seeded_raw, "2026-11-22", out_uri("snapshot"))
    assert first.returncode == 0, first.stderr[-2000:]
    version = step_result(first)["data_version"]
    assert isinstance(version, dict)
    tag = f"data-2026-11-22-7d-{version['content_hash'][:12]}"  # the window and the content
    assert version["tag"] == tag and version["new"] is True and version["records"] > 1000
    commits = registry_git("rev-list", "--count", "--all")

    again = snapshot(seeded_raw, "2026-11-22", out_uri("snapshot"))
    repeated = step_result(again)["data_version"]
    assert isinstance(repeated, dict)
    assert repeated["content_hash"] == version["content_hash"] and repeated["new"] is False
    assert registry_git("rev-list", "--count", "--all") == commits
    assert registry_git("tag", "--list", "data-2026-11-22-*") == tag

    # the same date with another look-back (a manual run): another tag, not a conflict
    shorter = snapshot(seeded_raw, "2026-11-22", out_uri("snapshot"), "--lookback-days", "3")
    assert shorter.returncode == 0, shorter.stderr[-2000:]
    other = step_result(shorter)["data_version"]
    assert isinstance(other, dict) and other["new"] is True and other["tag"].startswith("data-2026-11-22-3d-")

    # an audit or a backfill reads exactly that version back from the DVC remote
    read_back = subprocess.run(
        [str(RUNTIME_PY), "-c",
         "import dvc.api, sys; sys.stdout.buffer.write(dvc.api.read('data/snapshot.jsonl', "
         f"repo='{os.environ['DVC_REGISTRY_DIR']}', rev='{tag}', mode='rb'))"],
        capture_output=True, check=True,
    ).stdout
    assert hashlib.sha256(read_back).hexdigest() == version["content_hash"]

    # a replay restores that version as the step wrote it (HEAD holds the 3-day one meanwhile),
    # and leaves the registry's workspace on HEAD's
    restored_uri = out_uri("snapshot")
    restored = run_module("tasks.snapshot", "--restore", tag, "--output", restored_uri)
    assert restored.returncode == 0, restored.stderr[-2000:]
    assert step_result(restored)["data_version"] == {**version, "new": False}
    first_uri = str(step_result(first)["snapshot_uri"]).rsplit("/", 1)[0]
    for name in ("snapshot.jsonl", "snapshot.offsets.npy"):
        assert storage.read_bytes(f"{restored_uri}/{name}") == storage.read_bytes(f"{first_uri}/{name}"), name
    workspace = Path(os.environ["DVC_REGISTRY_DIR"]) / "data" / "snapshot.jsonl"
    assert hashlib.sha256(workspace.read_bytes()).hexdigest() == other["content_hash"]
    assert registry_git("status", "--porcelain") == ""
    # where the replay's plan looks for the version's data on the DVC remote (DVC 3's layout)
    from tasks.lib.params import load_settings
    from tasks.snapshot import registry

    remote = registry(load_settings().snapshot).remote_object(tag)
    assert remote.startswith("s3://dvc/registry/files/md5/") and storage.exists(remote)
    gone = run_module("tasks.snapshot", "--restore", "data-2026-11-22-7d-000000000000", "--output", out_uri("snapshot"))
    assert gone.returncode == 2 and error_lines(gone) == [
        "ERROR python -m tasks.snapshot: data version data-2026-11-22-7d-000000000000: no such tag in the DVC "
        f"registry {os.environ['DVC_REGISTRY_DIR']}"]


def test_two_run_ids_of_one_storage_key_never_share_a_folder(seeded_raw: str) -> None:
    """``manual__...T10:00:00+00:00`` and ``manual__...T10-00-00_00-00`` map to one run key: the
    second run's first step is refused before it writes, a retry of the first passes."""
    output = out_uri("runs/llm_retrain/manual__2026-11-22T10-00-00_00-00/snapshot")
    first = snapshot(seeded_raw, "2026-11-22", output, "--run-id", "manual__2026-11-22T10:00:00+00:00")
    assert first.returncode == 0, first.stderr[-2000:]
    manifest = storage.read_bytes(storage.join(output, "_SUCCESS"))
    other = snapshot(seeded_raw, "2026-11-21", output, "--run-id", "manual__2026-11-22T10-00-00_00-00")
    assert other.returncode == 2, other.stderr[-2000:]
    assert error_lines(other) == [
        "ERROR python -m tasks.snapshot: --run-id 'manual__2026-11-22T10-00-00_00-00': its storage folder "
        f"{output.rsplit('/', 1)[0]} belongs to run 'manual__2026-11-22T10:00:00+00:00' (the two ids share one "
        "storage key): trigger this run with another run id"]
    assert storage.read_bytes(storage.join(output, "_SUCCESS")) == manifest  # the first run's output untouched
    retry = snapshot(seeded_raw, "2026-11-22", output, "--run-id", "manual__2026-11-22T10:00:00+00:00")
    assert retry.returncode == 0, retry.stderr[-2000:]


def test_parallel_snapshots_queue_on_the_registry_lock(seeded_raw: str) -> None:
    procs = [
        subprocess.Popen(
            [str(RUNTIME_PY), "-m", "tasks.snapshot", "--source", seeded_raw, "--end-date", end,
             "--output", out_uri("snapshot")],
            stderr=subprocess.PIPE, text=True,
        )
        for end in ("2026-11-19", "2026-11-20", "2026-11-21")
    ]
    for proc in procs:
        _, err = proc.communicate(timeout=300)
        assert proc.returncode == 0, err[-2000:]
    tags = registry_git("tag", "--list", "data-2026-11-*").split()
    assert {"2026-11-19", "2026-11-20", "2026-11-21"} <= {t[len("data-"):][:10] for t in tags}


@pytest.mark.parametrize(
    ("body", "message"),
    [
        (b'{"id": "1", "text": "caf\xe9 au lait", "source": "s", "created_at": "t"}\n', "invalid UTF-8"),
        (b'{"id": "1", "text": "fine text here", "source": "s", "created_at": "t"}\n{"id": 2,\n', "invalid JSON"),
        (b'{"id": "1", "source": "s", "created_at": "t"}\n', "record missing 'text'"),
        (json.dumps({"id": "1", "text": "x" * 50_000_000, **GOOD}).encode(), "record of 50.0 MB exceeds"),
    ],
    ids=["invalid-utf8", "invalid-json", "missing-text", "50mb-record"],
)
def test_bad_raw_data_fails_snapshot_with_one_line(stack_env: dict[str, str], body: bytes, message: str) -> None:
    source = f"s3://raw/bad-{uuid.uuid4().hex[:8]}"
    write_partition(source, "2026-11-10", body)
    output = out_uri("snapshot")
    proc = snapshot(source, "2026-11-11", output, "--lookback-days", "3")
    assert proc.returncode == 2
    errors = error_lines(proc)
    assert len(errors) == 1 and message in errors[0] and "date=2026-11-10/part-00000.jsonl" in errors[0]
    assert storage.list_files(output) == []


def test_a_half_ingested_partition_is_never_read(stack_env: dict[str, str]) -> None:
    """A window partition with data but no _SUCCESS marker (its ingestion still writing, or died
    midway) stops the snapshot with one line naming it, nothing written; once its marker lands
    the same window reads it."""
    source = f"s3://raw/half-{uuid.uuid4().hex[:8]}"
    rows = "".join(json.dumps({"id": f"r{i}", "text": f"record number {i} of a day", **GOOD}) + "\n" for i in range(5))
    write_partition(source, "2026-11-20", rows.encode())
    write_partition(source, "2026-11-21", rows.replace('"r', '"s').encode(), complete=False)
    output = out_uri("snapshot")
    proc = snapshot(source, "2026-11-22", output, "--lookback-days", "2")
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert error_lines(proc) == [f"ERROR python -m tasks.snapshot: {source}/date=2026-11-21: 1 data file(s) but no "
                                 "_SUCCESS marker: a partition still being written, or whose ingestion failed, is not "
                                 "read (land it again, or remove it)"]
    assert storage.list_files(output) == []
    write_partition(source, "2026-11-21", rows.replace('"r', '"s').encode())  # its ingestion finished
    proc = snapshot(source, "2026-11-22", output, "--lookback-days", "2")
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert step_result(proc)["data_version"]["records"] == 10


def test_empty_interval_fails(stack_env: dict[str, str]) -> None:
    output = out_uri("snapshot")
    proc = snapshot(f"s3://raw/empty-{uuid.uuid4().hex[:8]}", "2026-11-22", output)
    assert proc.returncode == 2
    assert "empty interval" in error_lines(proc)[0]
    assert storage.list_files(output) == []


def test_a_drift_retrain_without_data_newer_than_the_champions_is_refused(stack_env: dict[str, str],
                                                                          tmp_path: Path) -> None:
    """A retrain the drift check started would train on the data its champion saw when no raw
    partition landed after the champion's window: one line naming the drift report and the day,
    nothing written. A day of new data lets it through; a run something else started, or one
    whose champion carries no window, is not asked."""
    from mlflow import MlflowClient

    env = params_with_model_name("drift-data", tmp_path)
    client = MlflowClient()
    client.create_registered_model(env["MODEL_NAME"])
    champion = client.create_model_version(env["MODEL_NAME"], "s3://mlflow/x", tags={"data_end": "2026-11-21"}).version
    untagged = client.create_model_version(env["MODEL_NAME"], "s3://mlflow/y").version
    source = f"s3://raw/drift-{uuid.uuid4().hex[:8]}"
    rows = "".join(json.dumps({**GOOD, "id": f"r{i}", "text": f"drifted text number {i} of the week"}) + "\n"
                   for i in range(10))
    write_partition(source, "2026-11-19", rows.encode())  # all the champion saw
    drift = {"drift_report": "s3://pipeline/runs/llm_drift/x/drift/report.html", "champion": champion}

    def run(trigger: dict[str, str], output: str) -> subprocess.CompletedProcess[str]:
        return run_module("tasks.snapshot", "--source", source, "--end-date", "2026-11-23", "--lookback-days", "5",
                          "--output", output, "--trigger", json.dumps(trigger), env=env)

    output = out_uri("snapshot")
    refused = run(drift, output)
    assert refused.returncode == 2, refused.stderr[-2000:]
    assert error_lines(refused) == [
        f"ERROR python -m tasks.snapshot: --trigger: this retrain was started by the drift check ({drift['drift_report']}), but {source} holds no "
        f"partition from 2026-11-21 on, after champion v{champion}'s data, and captured traffic is not training "
        "data (snapshot.learn_from_traffic): nothing new to learn from (land data of the drifted domain, e.g. make "
        "import, then retrain)"]
    assert storage.list_files(output) == []
    for passing in ({}, {**drift, "champion": untagged}):  # not started by the drift check; no window to compare
        assert run(passing, out_uri("snapshot")).returncode == 0
    # the line lets it learn from the check's captured prompts: they are its new data (on S3, as served)
    served, report = f"{source}-served", f"{source}-drift/drift/report.html"
    start = dt.datetime(2026, 11, 22, 9, tzinfo=dt.UTC)
    asked = [f"служба номер {i} не отвечает на запрос клиента" for i in range(40)]
    storage.write_bytes(f"{served}/date=2026-11-22/part-0.jsonl", "".join(
        json.dumps({"time": (start + dt.timedelta(minutes=i)).isoformat(), "prompt": p, "client": f"c{i % 4}"}) + "\n"
        for i, p in enumerate(asked)).encode())
    storage.write_bytes(storage.sibling(report, "report.json"), json.dumps(
        {"verdict": "drift", "served_uri": served, "window": {"start": start.isoformat(), "end": "2026-11-23T09:00:00+00:00"}}).encode())
    learning = {**drift, "drift_report": report}
    output = out_uri("snapshot")
    learnt = run_module("tasks.snapshot", "--source", source, "--end-date", "2026-11-23", "--lookback-days", "5",
                        "--output", output, "--trigger", json.dumps(learning), "--set", "learn_from_traffic=true",
                        "--set", "traffic_max_share=0.5", env=env)
    assert learnt.returncode == 0, learnt.stderr[-2000:]
    assert step_result(learnt)["traffic_records"] > 0
    stats = storage.read_json(storage.join(output, "stats.json"))["traffic"]
    assert stats["prompts"] == 40 and stats["trained"] == step_result(learnt)["traffic_records"], stats
    assert stats["trained"] + stats["held_out"] + stats["capped"] + stats["duplicates"] == 40, stats
    # none left by the filters (checked first), or none within the share (checked once the documents are read)
    for limit in ("traffic_min_chars=1000", "traffic_max_share=0.0001"):
        output = out_uri("snapshot")
        nothing = run_module("tasks.snapshot", "--source", source, "--end-date", "2026-11-23", "--lookback-days",
                             "5", "--output", output, "--trigger", json.dumps(learning), "--set",
                             "learn_from_traffic=true", "--set", limit, env=env)
        assert nothing.returncode == 2 and "the captured prompts left none to learn from" in error_lines(nothing)[0]
        assert storage.list_files(output) == []
    write_partition(source, "2026-11-22", rows.replace("text number", "new text number").encode())
    assert run(drift, out_uri("snapshot")).returncode == 0


def test_validation_passes_on_real_text_and_saves_report(seeded_raw: str) -> None:
    snap = step_result(snapshot(seeded_raw, "2026-11-15", out_uri("snapshot")))
    output = out_uri("validate")
    proc = run_module("tasks.validate", "--snapshot", str(snap["snapshot_uri"]), "--output", output)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = step_result(proc)
    assert result["success"] is True and result["evaluated"] == 12
    assert b"<html" in storage.read_bytes(str(result["report_uri"]))[:2000].lower()


def test_a_broken_snapshot_line_fails_validation_naming_it(stack_env: dict[str, str], tmp_path: Path) -> None:
    snapshot_file = tmp_path / "snapshot.jsonl"
    snapshot_file.write_text(json.dumps({"id": "1", "text": "a fine record", **GOOD}) + "\n{not json\n")
    output = out_uri("validate")
    proc = run_module("tasks.validate", "--snapshot", str(snapshot_file), "--output", output)
    assert proc.returncode == 2
    errors = error_lines(proc)
    assert len(errors) == 1 and f"{snapshot_file}:2: cannot be read as JSON Lines" in errors[0], errors
    assert storage.list_files(output) == []


def test_mostly_duplicates_fail_validation_and_stop_the_data_half(stack_env: dict[str, str], tmp_path: Path) -> None:
    source = f"s3://raw/dups-{uuid.uuid4().hex[:8]}"
    lines = [json.dumps({"id": str(i), "text": f"distinct document number {i} with some text", **GOOD})
             for i in range(120)]
    lines += [json.dumps({"id": f"d{i}", "text": "the same boilerplate paragraph, again and again", **GOOD})
              for i in range(1080)]
    write_partition(source, "2026-11-10", ("\n".join(lines) + "\n").encode())
    snap = snapshot(source, "2026-11-11", out_uri("snapshot"), "--lookback-days", "2")
    assert snap.returncode == 0, snap.stderr[-2000:]
    assert step_result(snap)["duplicates_removed"] == 1079

    output = out_uri("validate")
    proc = run_module("tasks.validate", "--snapshot", str(step_result(snap)["snapshot_uri"]), "--output", output,
                      "--set", "min_records=10")
    assert proc.returncode == 2
    error = error_lines(proc)[0]
    assert "expect_column_mean_to_be_between(copies): observed 9.9" in error
    # the report is kept for people to read; the summary names the failed expectation
    summary = storage.read_json(storage.join(output, "summary.json"))
    assert [(f["expectation"], f["column"]) for f in summary["failed"]] == [
        ("expect_column_mean_to_be_between", "copies"),
        ("partition_not_empty", "date=2026-11-09"),  # the window's other day has nothing
        ("partition_repeated_ratio", "date=2026-11-10"),
    ]
    assert storage.exists(storage.join(output, "report", "index.html"))


def test_one_bad_day_among_good_ones_fails_validation_naming_it(stack_env: dict[str, str]) -> None:
    """Six good days and one that is 90% copies of earlier days' texts: the window's totals
    pass (13% duplicates), the day itself does not."""
    from tasks import seed

    source = f"s3://raw/bad-day-{uuid.uuid4().hex[:8]}"
    texts = [text for _, text in seed.documents(1300)]
    for index, day in enumerate(f"2026-11-{d:02d}" for d in range(1, 7)):
        batch = texts[index * 200:(index + 1) * 200]
        write_partition(source, day, "".join(json.dumps({"id": f"{day}-{i}", "text": t, **GOOD}) + "\n"
                                             for i, t in enumerate(batch)).encode())
    injected = texts[:180] + texts[1200:1220]  # 180 of 200 repeat the first days' texts
    write_partition(source, "2026-11-07", "".join(json.dumps({"id": f"x-{i}", "text": t, **GOOD}) + "\n"
                                                  for i, t in enumerate(injected)).encode())
    snap = step_result(snapshot(source, "2026-11-08", out_uri("snapshot")))
    proc = run_module("tasks.validate", "--snapshot", str(snap["snapshot_uri"]), "--output", out_uri("validate"))
    assert proc.returncode == 2, proc.stderr[-3000:]
    error = error_lines(proc)[0]
    assert "failed 1/" in error and "partition_repeated_ratio(date=2026-11-07): 90% of its 200 records" in error


def test_champion_tokenizer_is_reused(seeded_raw: str, tmp_path: Path) -> None:
    from mlflow import MlflowClient

    snap = step_result(snapshot(seeded_raw, "2026-11-15", out_uri("snapshot")))
    trained = step_result(run_module(
        "tasks.tokenize", "prepare", "--snapshot", str(snap["snapshot_uri"]), "--output", out_uri("tok"),
        "--set", "vocab_size=600", env={"MLFLOW_TRACKING_URI": ""},
    ))
    assert trained["tokenizer_source"] == "trained"

    name = "llm-retrain"
    client = MlflowClient()
    if not client.search_registered_models(filter_string=f"name='{name}'"):
        client.create_registered_model(name)
    version = client.create_model_version(name, source="s3://mlflow/test-model", tags={
        "tokenizer_uri": str(trained["tokenizer_uri"])})
    client.set_registered_model_alias(name, "champion", version.version)

    reused = step_result(run_module(
        "tasks.tokenize", "prepare", "--snapshot", str(snap["snapshot_uri"]), "--output", out_uri("tok"),
        "--set", "vocab_size=900",  # ignored: a retrain keeps the production vocabulary
    ))
    assert reused["tokenizer_source"] == "champion"
    assert reused["tokenizer_hash"] == trained["tokenizer_hash"] and reused["vocab_size"] == 600
    assert reused["champion_model_uri"] == f"models:/{name}/{version.version}"  # pinned for train.init_from
    client.delete_registered_model_alias(name, "champion")


def test_registry_shared_through_a_git_remote_between_pods(seeded_raw: str, tmp_path: Path) -> None:
    """Cluster mode: each pod clones the registry, versions, and pushes; nothing on shared disk."""
    remote = tmp_path / "registry.git"
    subprocess.run(["git", "init", "-q", "--bare", "-b", "main", str(remote)], check=True)

    def pod(name: str, end: str) -> dict[str, object]:
        env = {"DVC_REGISTRY_DIR": str(tmp_path / name), "DVC_REGISTRY_GIT_REMOTE": str(remote)}
        proc = run_module("tasks.snapshot", "--source", seeded_raw, "--end-date", end,
                          "--output", out_uri("snapshot"), env=env)
        assert proc.returncode == 0, proc.stderr[-2000:]
        version = step_result(proc)["data_version"]
        assert isinstance(version, dict)
        return version

    first = pod("pod-a", "2026-11-18")
    pod("pod-b", "2026-11-17")
    again = pod("pod-c", "2026-11-18")  # a retry elsewhere finds the pushed tag
    assert again["new"] is False and again["content_hash"] == first["content_hash"]
    tags = subprocess.run(["git", "tag"], cwd=remote, capture_output=True, text=True, check=True).stdout.split()
    assert [t[:len("data-2026-11-17")] for t in tags] == ["data-2026-11-17", "data-2026-11-18"]
    assert tags[1] == first["tag"]

    # pod-a's tag never reached the remote (its push failed): its retry pushes the tag itself
    subprocess.run(["git", "tag", "-d", str(first["tag"])], cwd=remote, capture_output=True, check=True)
    retried = pod("pod-a", "2026-11-18")
    assert retried["new"] is False
    assert str(first["tag"]) in subprocess.run(["git", "tag"], cwd=remote, capture_output=True, text=True).stdout.split()
    # the data re-pushed is the tag's version, not whatever pod-a's HEAD holds by then
    pod("pod-a", "2026-11-16")  # HEAD moves to another version
    tagged = yaml.safe_load(subprocess.run(["git", "show", f"{first['tag']}:data/snapshot.jsonl.dvc"],
                                           cwd=tmp_path / "pod-a", capture_output=True, text=True, check=True).stdout)
    md5 = tagged["outs"][0]["md5"]
    stored = f"s3://dvc/registry/files/md5/{md5[:2]}/{md5[2:]}"
    assert storage.exists(stored)
    bucket, key = storage.split_s3(stored)
    storage.s3_client().delete_object(Bucket=bucket, Key=key)  # lost, as if that push had died
    assert pod("pod-a", "2026-11-18")["new"] is False
    assert storage.exists(stored)


def test_snapshot_runs_on_a_read_only_root_like_a_pod(seeded_raw: str, tmp_path: Path) -> None:
    """The image's root filesystem is read-only in a pod (readOnlyRootFilesystem): the snapshot
    step, with its registry and DVC's site cache, writes only under the temp folder. Run with the
    code on a read-only bind mount and /var/tmp read-only too, in a mount namespace of its own."""
    image = tmp_path / "image"
    shutil.copytree(REPO_ROOT / "tasks", image / "tasks", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(REPO_ROOT / "params.yaml", image / "params.yaml")
    writable = tmp_path / "tmp"
    writable.mkdir()
    command = (f"mount --bind {image} {image} && mount -o remount,bind,ro {image} && "
               "mount --bind /var/tmp /var/tmp && mount -o remount,bind,ro /var/tmp && "
               f"touch {image}/probe 2>/dev/null && echo 'root is writable' && exit 3; "
               f"exec {RUNTIME_PY} -m tasks.snapshot --source {seeded_raw} --end-date 2026-11-22 "
               f"--output {out_uri('snapshot')}")
    env = {k: v for k, v in os.environ.items() if k not in ("DVC_REGISTRY_DIR", "DVC_SITE_CACHE_DIR")}
    env.update(TMPDIR=str(writable), HOME=str(writable), PYTHONPATH=str(image), PYTHONDONTWRITEBYTECODE="1")
    proc = subprocess.run(["unshare", "-m", "sh", "-c", command], cwd=image, env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stdout[-1000:] + proc.stderr[-3000:]
    assert step_result(proc)["data_version"]["new"] is True  # type: ignore[index]
    assert (writable / "dvc-registry" / ".dvc").is_dir()


def write_corpus(root: Path, megabytes: int, days: list[str]) -> None:
    """Distinct ~1 KB records, ``megabytes`` in all, in 1 MB files spread evenly over ``days``."""
    filler = "lorem ipsum dolor sit amet " * 40
    per_file, index = 1_000, 0
    for file_no in range(megabytes):
        day = days[file_no % len(days)]
        folder = root / f"date={day}"
        folder.mkdir(parents=True, exist_ok=True)
        with (folder / f"part-{file_no:05d}.jsonl").open("w") as fh:
            for _ in range(per_file):
                fh.write(json.dumps({"id": str(index), "text": f"record {index}: {filler}", **GOOD}) + "\n")
                index += 1
    for day in days:  # each partition complete, as its ingestion leaves it
        (root / f"date={day}" / "_SUCCESS").touch()


@pytest.mark.integration
def test_data_steps_memory_does_not_grow_with_the_corpus(stack_env: dict[str, str], tmp_path: Path) -> None:
    """Snapshot de-duplicates through a spill file and an on-disk index; validation runs its
    suite as SQL over an on-disk SQLite copy: for a 5x larger window the peak RSS of each step
    grows by a small fraction of the extra data (holding the records, in a dict or a pandas
    frame, grew it by more than the extra data itself). Outputs go to local folders: an S3 upload
    adds boto3's transfer buffers (up to 10 parts of 8 MB in flight: +16 MB for the 80 MB
    snapshot), bounded by its settings, not by the corpus."""
    days = [f"2026-10-0{d}" for d in range(1, 8)]

    def peak_rss_mb(megabytes: int) -> tuple[float, float]:
        raw = tmp_path / f"raw-{megabytes}"
        write_corpus(raw, megabytes, days)
        peaks = tmp_path / f"snapshot-{megabytes}", tmp_path / f"validate-{megabytes}"
        snap = step_result(run_measuring_peak_rss(
            "tasks.snapshot", "--source", str(raw), "--end-date", "2026-10-08", "--output", str(peaks[0]) + "-out",
            peak=peaks[0]))
        assert snap["data_version"]["records"] == megabytes * 1000  # type: ignore[index]
        validated = step_result(run_measuring_peak_rss(
            "tasks.validate", "--snapshot", str(snap["snapshot_uri"]), "--output", str(peaks[1]) + "-out",
            peak=peaks[1]))
        assert validated["records"] == megabytes * 1000
        return int(peaks[0].read_text()) / 1024, int(peaks[1].read_text()) / 1024

    small, large = peak_rss_mb(16), peak_rss_mb(80)
    for step, before, after in zip(["snapshot", "validate"], small, large, strict=True):
        assert after - before < 0.25 * (80 - 16), (step, before, after)
