"""Tokenizer choice, sharding, dtype and the 1-vs-N determinism of the tokenize step."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from helpers import error_lines, run_measuring_peak_rss, run_module, step_result, tokenize

from tasks.lib import records, tokens
from tasks.lib.errors import StepError


@pytest.mark.parametrize(("vocab", "dtype"), [(1000, np.uint16), (65536, np.uint16), (65537, np.uint32)])
def test_token_dtype(vocab: int, dtype: type) -> None:
    assert tokens.token_dtype(vocab) == np.dtype(dtype)


@pytest.mark.parametrize("num_shards", [1, 2, 3, 7, 50])
def test_shards_cover_every_record_once_with_even_bytes(num_shards: int) -> None:
    # 23 records: short ones first, then long ones (as when a day of long documents follows)
    lengths = np.array([10] * 12 + [1000] * 11)
    offsets = tokens.offsets_from_lengths(lengths)
    ranges = [tokens.shard_range(offsets, i, num_shards) for i in range(num_shards)]
    covered = [i for start, end in ranges for i in range(start, end)]
    assert covered == list(range(23))
    share = lengths.sum() / num_shards
    if num_shards <= 11:  # fewer shards than long records: each within one record of an even share
        assert all(abs(int(offsets[end] - offsets[start]) - share) <= 1000 for start, end in ranges)


@pytest.mark.parametrize("chunk", [1, 3, 7, 1000])
def test_lines_arriving_in_any_chunks_are_the_same_lines(chunk: int) -> None:
    data = b'{"a": 1}\n{"b": "two"}\n\n{"c": 3}'  # the last line without its newline
    chunks = [data[i : i + chunk] for i in range(0, len(data), chunk)]
    assert list(tokens.lines_in(chunks)) == data.split(b"\n")
    batches = list(tokens.record_batches(tokens.lines_in(chunks), batch_bytes=8, where="s"))
    assert batches == [[{"a": 1}], [{"b": "two"}], [{"c": 3}]]  # a batch closes at 8 bytes of lines


@pytest.mark.parametrize("line", [b'{"text": "no hash"}', b'["text", "content_hash"]', b'{"text": 3, "content_hash": "ab"}'])
def test_a_record_without_its_fields_is_named_by_line(line: bytes) -> None:
    lines = [b'{"text": "a", "content_hash": "ab"}', line]
    with pytest.raises(StepError) as refused:
        list(tokens.record_batches(lines, batch_bytes=1, where="snap.jsonl", required=("text", "content_hash")))
    assert str(refused.value).startswith("snap.jsonl: line 2 has no string "), refused.value


def test_split_depends_only_on_document_hash() -> None:
    hashes = [records.content_hash(str(i)) for i in range(4000)]
    splits = [tokens.split_of(h, 0.05) for h in hashes]
    assert splits == [tokens.split_of(h, 0.05) for h in reversed(hashes)][::-1]
    assert 0.03 < splits.count("val") / len(splits) < 0.07


def test_one_and_three_workers_write_identical_datasets(snapshot: Path, tokenizer_uri: str, tmp_path: Path) -> None:
    one = tokenize(snapshot, tokenizer_uri, tmp_path / "n1", 1)
    three = tokenize(snapshot, tokenizer_uri, tmp_path / "n3", 3)
    assert one["tokens"] == three["tokens"]
    names = ["train.bin", "val.bin", "train.offsets.npy", "val.offsets.npy", "index.json"]
    for name in names:
        assert (tmp_path / "n1/dataset" / name).read_bytes() == (tmp_path / "n3/dataset" / name).read_bytes(), name
    index = json.loads((tmp_path / "n1/dataset/index.json").read_text())
    assert index["dtype"] == "uint16" and index["splits"]["val"]["documents"] > 0
    train = np.memmap(tmp_path / "n1/dataset/train.bin", dtype=index["dtype"], mode="r")
    offsets = np.load(tmp_path / "n1/dataset/train.offsets.npy")
    assert len(train) == offsets[-1] == index["splits"]["train"]["tokens"]
    assert train[offsets[1] - 1] == index["eos_id"]  # every document ends with EOS


def test_explicit_tokenizer_is_reused_not_retrained(snapshot: Path, tokenizer_uri: str, tmp_path: Path) -> None:
    proc = run_module(
        "tasks.tokenize", "prepare", "--snapshot", str(snapshot), "--tokenizer", tokenizer_uri,
        "--output", str(tmp_path / "prepare"), "--set", f"tokenizer_store={tmp_path / 'store'}",
        env={"MLFLOW_TRACKING_URI": ""},
    )
    result = step_result(proc)
    assert result["tokenizer_source"] == "explicit"
    assert tokenizer_uri.endswith(f"sha256-{result['tokenizer_hash']}/tokenizer.json")


def test_merge_with_a_missing_shard_fails_and_writes_nothing(snapshot: Path, tokenizer_uri: str, tmp_path: Path) -> None:
    proc = run_module(
        "tasks.tokenize", "merge", "--snapshot", str(snapshot), "--tokenizer", tokenizer_uri,
        "--num-shards", "2", "--shards", str(tmp_path / "nowhere"), "--output", str(tmp_path / "dataset"),
    )
    assert proc.returncode == 2
    assert error_lines(proc) and "not a complete step output" in error_lines(proc)[0]
    assert not (tmp_path / "dataset").exists()


def test_each_shard_reads_only_its_byte_range(snapshot: Path, tokenizer_uri: str, tmp_path: Path) -> None:
    """With the snapshot step's byte offsets beside it, a shard reads its own records' bytes
    only (memory bounded by the shard, not the corpus), and the dataset is the same."""
    from tasks.snapshot import write_snapshot

    ranged = tmp_path / "ranged"
    ranged.mkdir()
    kept = [json.loads(line) for line in snapshot.read_text().splitlines()]
    write_snapshot(records.normalize_and_dedup(iter(kept)), ranged)
    offsets = np.load(ranged / "snapshot.offsets.npy")
    assert len(offsets) == len(kept) + 1 and offsets[-1] == (ranged / "snapshot.jsonl").stat().st_size
    whole = tmp_path / "whole"
    whole.mkdir()
    (whole / "snapshot.jsonl").write_bytes((ranged / "snapshot.jsonl").read_bytes())  # no offsets: full reads
    by_range = tokenize(ranged / "snapshot.jsonl", tokenizer_uri, tmp_path / "r", 3)
    by_file = tokenize(whole / "snapshot.jsonl", tokenizer_uri, tmp_path / "w", 3)
    assert by_range["tokens"] == by_file["tokens"]
    for name in ("train.bin", "val.bin", "train.offsets.npy", "val.offsets.npy"):  # index.json names its snapshot
        assert (tmp_path / "r/dataset" / name).read_bytes() == (tmp_path / "w/dataset" / name).read_bytes(), name
    # the other shards' bytes overwritten with garbage (same length): shard 1 never sees them
    start, end = tokens.shard_range(offsets, 1, 3)
    data = bytearray((ranged / "snapshot.jsonl").read_bytes())
    data[: offsets[start]] = b"#" * int(offsets[start])
    data[offsets[end]:] = b"#" * (len(data) - int(offsets[end]))
    (ranged / "snapshot.jsonl").write_bytes(bytes(data))
    proc = run_module("tasks.tokenize", "encode", "--snapshot", str(ranged / "snapshot.jsonl"), "--tokenizer",
                      tokenizer_uri, "--shard-index", "1", "--num-shards", "3", "--output", str(tmp_path / "s1"))
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert step_result(proc)["records"] == [start, end]


def test_encode_memory_is_bounded_by_its_batch_not_its_shard(snapshot: Path, tokenizer_uri: str, tmp_path: Path) -> None:
    """A shard's records are streamed from its byte range in batches of ``tokenize.batch_bytes``:
    for a 5x larger shard the encode step's peak RSS grows by a fraction of the extra data (6 MB
    for 32 MB here; holding the shard's records, as before, grew it by 103 MB)."""
    lines = snapshot.read_bytes()

    def peak_rss_mb(megabytes: int) -> float:
        folder = tmp_path / f"{megabytes}mb"
        folder.mkdir()
        data = lines * -(-megabytes * 10**6 // len(lines))  # whole copies of the snapshot's lines
        (folder / "snapshot.jsonl").write_bytes(data)
        lengths = np.array([len(line) for line in data.splitlines(keepends=True)])
        np.save(folder / "snapshot.offsets.npy", tokens.offsets_from_lengths(lengths))
        peak = folder / "peak-rss"
        proc = run_measuring_peak_rss(
            "tasks.tokenize", "encode", "--snapshot", str(folder / "snapshot.jsonl"), "--tokenizer", tokenizer_uri,
            "--shard-index", "0", "--num-shards", "1", "--output", str(folder / "shard"),
            "--set", "batch_bytes=65536", peak=peak)
        assert step_result(proc)["records"] == [0, len(lengths)]
        return int(peak.read_text()) / 1024

    small, large = peak_rss_mb(8), peak_rss_mb(40)
    assert large - small < 0.5 * (40 - 8), (small, large)


def test_a_broken_snapshot_line_is_named(snapshot: Path, tokenizer_uri: str, tmp_path: Path) -> None:
    lines = snapshot.read_bytes().splitlines(keepends=True)
    lines[3] = b'{"text": "cut off\n'
    (tmp_path / "snapshot.jsonl").write_bytes(b"".join(lines))
    np.save(tmp_path / "snapshot.offsets.npy", tokens.offsets_from_lengths(np.array([len(line) for line in lines])))
    proc = run_module("tasks.tokenize", "encode", "--snapshot", str(tmp_path / "snapshot.jsonl"), "--tokenizer",
                      tokenizer_uri, "--shard-index", "0", "--num-shards", "1", "--output", str(tmp_path / "shard"))
    assert proc.returncode == 2
    assert error_lines(proc) == [f"ERROR python -m tasks.tokenize: {tmp_path / 'snapshot.jsonl'}: line 4 is not a JSON record "
                                 "(Unterminated string starting at)"]
    assert not (tmp_path / "shard").exists()


def test_only_a_drift_check_that_found_byte_fallback_grows_the_vocabulary(tmp_path: Path) -> None:
    """tokenize.grow_vocabulary lets a retrain grow its champion's vocabulary only when the drift
    check that started it found byte fallback; a champion of a Hugging Face base never grows."""
    import dataclasses

    from tasks.config import load
    from tasks.tokenize import Production, growth_wanted

    def drift_check(name: str, reasons: list[str]) -> str:
        (tmp_path / name).mkdir()
        (tmp_path / name / "report.json").write_text(json.dumps(
            {"verdict": "drift", "reasons": reasons, "champion": "1", "clients": {}}))
        return json.dumps({"drift_report": str(tmp_path / name / "report.html")})

    fallback = drift_check("fallback", ["byte fallback: 61.0% of tokens", "surprise: 140x"])
    surprise = drift_check("surprise", ["surprise: 3.5x the training text's"])
    params = load(section="tokenize").tokenize
    allowed = dataclasses.replace(params, grow_vocabulary=True)
    ours, based = Production("models:/m/1", "s3://t/tokenizer.json", ""), Production("models:/m/1", "s3://t", "abc")
    assert not params.grow_vocabulary  # off unless the line (or the run's Param) allows it
    assert not growth_wanted(fallback, params, ours)
    assert growth_wanted(fallback, allowed, ours)
    assert not growth_wanted(surprise, allowed, ours)
    assert not growth_wanted("", allowed, ours)  # a scheduled retrain keeps the vocabulary
    assert not growth_wanted(fallback, allowed, based)  # a base's tokenizer is kept (a warning says so)
