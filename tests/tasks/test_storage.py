"""Storage URIs: local and S3 through one API; outputs appear only when committed."""

from __future__ import annotations

import os
import socket
import time
import uuid
from pathlib import Path

import pytest

from tasks.lib import storage
from tasks.lib.errors import StepError


def test_join_and_split() -> None:
    assert storage.join("s3://b/root/", "x", "/y") == "s3://b/root/x/y"
    assert storage.split_s3("s3://bucket/a/b.txt") == ("bucket", "a/b.txt")
    with pytest.raises(StepError, match="not an s3:// URI"):
        storage.split_s3("/tmp/x")


def test_staged_output_commits_with_manifest(tmp_path: Path) -> None:
    out = str(tmp_path / "run" / "step")
    with storage.staged_output(out) as scratch:
        (scratch / "a.txt").write_text("alpha")
        assert not Path(out).exists()  # nothing visible before the commit
    storage.require_complete(out)
    assert (Path(out) / "a.txt").read_text() == "alpha"
    manifest = storage.read_json(storage.join(out, storage.SUCCESS_MARKER))
    assert manifest["files"]["a.txt"]["bytes"] == 5


def test_failed_step_leaves_nothing_and_keeps_previous_result(tmp_path: Path) -> None:
    out = str(tmp_path / "step")
    with storage.staged_output(out) as scratch:
        (scratch / "v.txt").write_text("first")
    with pytest.raises(RuntimeError), storage.staged_output(out) as scratch:
        (scratch / "v.txt").write_text("half-written")
        raise RuntimeError("step crashed")
    assert (Path(out) / "v.txt").read_text() == "first"
    assert [p.name for p in tmp_path.iterdir()] == ["step"]  # no staging leftovers


def test_retry_replaces_previous_output(tmp_path: Path) -> None:
    out = str(tmp_path / "step")
    for content in ("one", "two"):
        with storage.staged_output(out) as scratch:
            (scratch / "v.txt").write_text(content)
    assert (Path(out) / "v.txt").read_text() == "two"


def test_incomplete_output_is_refused(tmp_path: Path) -> None:
    (tmp_path / "partial").mkdir()
    with pytest.raises(StepError, match="not a complete step output"):
        storage.require_complete(str(tmp_path / "partial"))


@pytest.mark.integration
def test_s3_round_trip_and_commit(stack_env: dict[str, str], tmp_path: Path) -> None:
    out = f"s3://pipeline/tests/{uuid.uuid4().hex}/step"
    with storage.staged_output(out) as scratch:
        (scratch / "nested").mkdir()
        (scratch / "nested" / "b.bin").write_bytes(b"\x00\x01" * 1000)
        big = os.urandom(2 * storage.PART_BYTES + 1)  # sent as a multipart upload, in 3 parts
        (scratch / "big.bin").write_bytes(big)
    storage.require_complete(out)
    assert storage.read_bytes(storage.join(out, "nested/b.bin")) == b"\x00\x01" * 1000
    assert b"".join(storage.iter_range(storage.join(out, "nested/b.bin"), 11, 21)) == (b"\x00\x01" * 1000)[11:21]
    streamed = list(storage.iter_range(storage.join(out, "nested/b.bin"), 11, 1500, chunk_bytes=100))
    assert b"".join(streamed) == (b"\x00\x01" * 1000)[11:1500] and max(map(len, streamed)) <= 100
    local = storage.download_tree(out, tmp_path / "copy")
    assert (local / "nested" / "b.bin").stat().st_size == 2000 and (local / "big.bin").read_bytes() == big
    # a retry first clears leftovers of the earlier attempt
    storage.s3_client().put_object(Bucket="pipeline", Key=storage.split_s3(out)[1] + "/stale.txt", Body=b"x")
    with storage.staged_output(out) as scratch:
        (scratch / "c.txt").write_text("c")
    assert [u.rsplit("/", 1)[1] for u in storage.list_files(out)] == ["_SUCCESS", "c.txt"]
    with pytest.raises(StepError, match="no such object"):
        storage.read_bytes(storage.join(out, "missing.txt"))


def test_a_local_range_streams_in_chunks(tmp_path: Path) -> None:
    (tmp_path / "f.bin").write_bytes(bytes(range(256)) * 4)
    streamed = list(storage.iter_range(str(tmp_path / "f.bin"), 5, 1000, chunk_bytes=64))
    assert b"".join(streamed) == (bytes(range(256)) * 4)[5:1000] and max(map(len, streamed)) == 64
    with pytest.raises(StepError, match="no such file"):
        list(storage.iter_range(str(tmp_path / "missing.bin"), 0, 10))


def test_s3_failures_are_classified_by_what_a_retry_can_change() -> None:
    """Missing or forbidden: bad input (exit 2, no retry). 5xx, throttling, a dropped
    connection: transient (exit 1, retried). botocore's own exception types, as boto3 raises them."""
    from botocore.exceptions import ClientError, EndpointConnectionError

    def client_error(code: str, status: int) -> ClientError:
        return ClientError({"Error": {"Code": code}, "ResponseMetadata": {"HTTPStatusCode": status}}, "GetObject")

    for code, status in (("NoSuchKey", 404), ("404", 404), ("NoSuchBucket", 404), ("AccessDenied", 403)):
        assert isinstance(storage.s3_error("s3://b/k", "read", client_error(code, status)), StepError), code
    for code, status in (("SlowDown", 503), ("InternalError", 500), ("ServiceUnavailable", 503)):
        error = storage.s3_error("s3://b/k", "read", client_error(code, status))
        assert isinstance(error, storage.StorageUnavailable) and str(status) in str(error), code
    dropped = EndpointConnectionError(endpoint_url="http://127.0.0.1:9")
    assert isinstance(storage.s3_error("s3://b/k", "read", dropped), storage.StorageUnavailable)


@pytest.mark.integration
def test_missing_s3_object_is_bad_input_on_every_read(stack_env: dict[str, str], tmp_path: Path) -> None:
    missing = f"s3://pipeline/tests/{uuid.uuid4().hex}/nothing.json"
    for read in (lambda: storage.read_bytes(missing), lambda: storage.download(missing, tmp_path / "x")):
        with pytest.raises(StepError, match="no such object"):
            read()
    with pytest.raises(StepError, match="no such bucket"):
        storage.list_files(f"s3://no-such-bucket-{uuid.uuid4().hex[:8]}/x")


def commit_files(uri: str, files: dict[str, bytes]) -> None:
    with storage.staged_output(uri) as scratch:
        for name, data in files.items():
            (scratch / name).parent.mkdir(parents=True, exist_ok=True)
            (scratch / name).write_bytes(data)


def overwrite(uri: str, data: bytes) -> None:
    """Change a committed file behind its manifest's back (local or S3)."""
    if storage.is_s3(uri):
        bucket, key = storage.split_s3(uri)
        storage.s3_client().put_object(Bucket=bucket, Key=key, Body=data)
    else:
        Path(uri).write_bytes(data)


@pytest.fixture(params=["local", pytest.param("s3", marks=pytest.mark.integration)])  # s3: the stack's server
def output_uri(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    if request.param == "local":
        return str(tmp_path / "dataset")
    request.getfixturevalue("stack_env")
    return f"s3://pipeline/tests/{uuid.uuid4().hex}/dataset"


def test_readers_verify_what_they_read_against_the_manifest(output_uri: str, tmp_path: Path) -> None:
    """Local folders are read in place, S3 ones downloaded (s3fs, concurrently): either way
    what is read is what was committed."""
    out = output_uri
    commit_files(out, {"tokens.bin": b"\x01" * 64, "meta/info.json": b"{}"})
    copy = storage.download_tree(out, tmp_path / "copy")
    assert (copy / "tokens.bin").read_bytes() == b"\x01" * 64 and (copy / "meta" / "info.json").read_bytes() == b"{}"
    committed = storage.read_manifest(out)
    # replaced by a retried writer while being read: transient (the task retries and reads the new one)
    commit_files(out, {"tokens.bin": b"\x03" * 64})
    with pytest.raises(storage.StorageUnavailable, match="which changed meanwhile"):
        storage.download_tree(out, tmp_path / "copy2", committed)
    assert (storage.download_tree(out, tmp_path / "copy3") / "tokens.bin").read_bytes() == b"\x03" * 64
    # changed and staying so (same size, other bytes): bad input, named, no retry
    overwrite(storage.join(out, "tokens.bin"), b"\x02" * 64)
    with pytest.raises(StepError, match=r"tokens.bin: missing or differs from its _SUCCESS manifest .* read twice: a tampered"):
        storage.download_tree(out, tmp_path / "copy4")


@pytest.mark.integration
def test_a_file_the_manifest_lists_but_s3_lacks_is_bad_input(stack_env: dict[str, str], tmp_path: Path) -> None:
    out = f"s3://pipeline/tests/{uuid.uuid4().hex}/dataset"
    commit_files(out, {"a.bin": b"a", "b.bin": b"b"})
    storage.s3_client().delete_object(Bucket="pipeline", Key=storage.split_s3(out)[1] + "/b.bin")
    with pytest.raises(StepError, match=r"b.bin: missing or differs from its _SUCCESS manifest .* read twice"):
        storage.download_tree(out, tmp_path / "copy")


@pytest.mark.integration
def test_folder_transfers_name_a_refused_credential_and_an_unreachable_server(
        stack_env: dict[str, str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A wrong secret is bad input (exit 2: a retry sends the same one); a server that does not
    answer is transient (exit 1: the task retries). Nothing is committed either way."""
    out = f"s3://pipeline/tests/{uuid.uuid4().hex}/step"
    commit_files(out, {"a.bin": b"a"})
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "not-the-secret")
    with pytest.raises(StepError, match="access denied"):
        storage.download_tree(out, tmp_path / "copy", {"files": {"a.bin": {"bytes": 1, "sha256": "0" * 64}}})
    with pytest.raises(StepError, match="access denied"):
        commit_files(out + "-denied", {"a.bin": b"a"})
    monkeypatch.undo()
    assert not storage.exists(storage.join(out + "-denied", storage.SUCCESS_MARKER))
    with socket.socket() as closed:  # a port nothing listens on
        closed.bind(("127.0.0.1", 0))
        monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://127.0.0.1:{closed.getsockname()[1]}")
        monkeypatch.setenv("AWS_MAX_ATTEMPTS", "2")  # (the default 5 backs off for ~25 s)
        with pytest.raises(storage.StorageUnavailable, match="transient, the task retries"):
            storage.download_tree(out, tmp_path / "copy", {"files": {"a.bin": {"bytes": 1, "sha256": "0" * 64}}})


def test_s3fs_failures_are_classified_like_boto3s() -> None:
    """The exceptions s3fs raises (its own translation of botocore's, original as cause)."""
    from botocore.exceptions import ClientError, EndpointConnectionError
    from s3fs.errors import translate_boto_error

    def raised_by_s3fs(code: str, status: int) -> BaseException:
        error = ClientError({"Error": {"Code": code, "Message": code},
                             "ResponseMetadata": {"HTTPStatusCode": status}}, "GetObject")
        return translate_boto_error(error)

    def classified(exc: BaseException) -> Exception:
        with pytest.raises(Exception) as caught, storage.s3fs_call("s3://b/k", "download"):
            raise exc
        return caught.value

    for code, status in (("NoSuchKey", 404), ("NoSuchBucket", 404), ("AccessDenied", 403), ("InvalidAccessKeyId", 403)):
        assert isinstance(classified(raised_by_s3fs(code, status)), StepError), code
    for code, status in (("InternalError", 500), ("ServiceUnavailable", 503), ("SlowDown", 503)):
        assert isinstance(classified(raised_by_s3fs(code, status)), storage.StorageUnavailable), code
    assert isinstance(classified(EndpointConnectionError(endpoint_url="http://127.0.0.1:9")), storage.StorageUnavailable)
    assert isinstance(classified(TimeoutError("read timed out")), storage.StorageUnavailable)
    assert isinstance(classified(FileNotFoundError("s3://b/k")), storage.MissingObject)


@pytest.mark.parametrize("name", ["../escaped.pth", "/tmp/escaped.pth", "a/../../escaped.pth"])
def test_a_manifest_name_outside_the_folder_is_refused_before_anything_is_written(
        stack_env: dict[str, str], tmp_path: Path, name: str) -> None:
    """A ``_SUCCESS`` naming a file outside its folder (absolute, ``..``) would have the reader
    write it there (a ``.pth`` in the venv runs code in every later step): refused, exit 2."""
    import json

    out = f"s3://pipeline/tests/{uuid.uuid4().hex}/step"
    bucket, key = storage.split_s3(out)
    manifest = {"files": {"ok.txt": {"bytes": 2, "sha256": storage.sha256_file(Path(__file__))},
                          name: {"bytes": 2, "sha256": "0" * 64}}}
    for part, body in (("ok.txt", b"ok"), ("_SUCCESS", json.dumps(manifest).encode())):  # (S3 refuses ".." keys)
        storage.s3_client().put_object(Bucket=bucket, Key=f"{key}/{part}", Body=body)
    local = tmp_path / "deep" / "copy"
    with pytest.raises(StepError, match=r"_SUCCESS: file name .* (is not a path inside|resolves outside)"):
        storage.download_tree(out, local)
    assert not any(tmp_path.rglob("*.pth")) and not Path("/tmp/escaped.pth").exists() and not local.exists()
    with pytest.raises(StepError, match="is not a path inside"):  # a local output too
        storage.manifest_names(str(tmp_path), manifest, tmp_path)


def test_content_addressed_output_is_written_once_and_never_replaced(tmp_path: Path) -> None:
    """Another run may be reading it: a second writer keeps the first one's files."""
    folder = tmp_path / "store" / "sha256-abc"
    with storage.staged_output(str(folder), write_once=True) as scratch:
        (scratch / "tokenizer.json").write_text("{}")
    first = (folder / "tokenizer.json").stat().st_ino
    with storage.staged_output(str(folder), write_once=True) as scratch:
        (scratch / "tokenizer.json").write_text("{}")
    assert (folder / "tokenizer.json").stat().st_ino == first
    assert not [p for p in folder.parent.iterdir() if p.name.startswith(".")]  # no staging left behind


def test_a_tokenizer_whose_content_does_not_match_its_name_is_refused(tmp_path: Path) -> None:
    from tasks.lib import tokens

    tokenizer = tokens.train_tokenizer(["some text to learn from"] * 50, 300, 50)
    good = tmp_path / f"sha256-{tokens.tokenizer_hash(tokenizer.to_str())}" / "tokenizer.json"
    good.parent.mkdir()
    good.write_text(tokenizer.to_str())
    assert tokens.load_vocabulary(str(good), tmp_path).tokenizer.get_vocab_size() == tokenizer.get_vocab_size()
    bad = tmp_path / f"sha256-{'0' * 64}" / "tokenizer.json"
    bad.parent.mkdir()
    bad.write_text(tokenizer.to_str())
    with pytest.raises(storage.StorageUnavailable, match="does not hash to its name"):
        tokens.load_vocabulary(str(bad), tmp_path)


@pytest.mark.integration
def test_write_once_on_s3_deletes_nothing(stack_env: dict[str, str]) -> None:
    folder = f"s3://pipeline/tests/{uuid.uuid4().hex}/sha256-abc"
    storage.write_bytes(storage.join(folder, "tokenizer.json"), b"{}")  # a first writer, mid-upload
    storage.write_bytes(storage.join(folder, "reader-held.txt"), b"x")
    with storage.staged_output(folder, write_once=True) as scratch:
        (scratch / "tokenizer.json").write_text("{}")
    assert [u.rsplit("/", 1)[1] for u in storage.list_files(folder)] == ["_SUCCESS", "reader-held.txt", "tokenizer.json"]


@pytest.mark.integration
def test_processes_seeded_alike_download_the_same_file_at_once(stack_env: dict[str, str], tmp_path: Path) -> None:
    """Ranks of one node resuming a checkpoint fetch the same files into the same folder, with
    `random` seeded alike (boto3 names its temporary file with it): none may fail or leave a
    partial file. (Failed in CI before downloads went through a per-process name.)"""
    import subprocess
    import sys

    uri = f"s3://pipeline/tests/{uuid.uuid4().hex}/blob.bin"
    source = tmp_path / "blob.bin"
    source.write_bytes(b"x" * 1_000_000)
    storage.upload(source, uri)
    target = tmp_path / "node" / "blob.bin"
    start = time.time() + 8  # the processes download in step, as ranks leaving a barrier do
    script = ("import random, time; from pathlib import Path; from tasks.lib import storage\n"
              "random.seed(1234)\n"
              "for i in range(10):\n"
              f"    time.sleep(max(0.0, {start} + 0.3 * i - time.time()))\n"
              f"    storage.download({uri!r}, Path({str(target)!r}))\n")
    procs = [subprocess.Popen([sys.executable, "-c", script], cwd=Path(storage.__file__).parents[2],
                              stderr=subprocess.PIPE, text=True) for _ in range(3)]
    errors = [p.communicate(timeout=300)[1] for p in procs]
    assert all(p.returncode == 0 for p in procs), [e[-1500:] for e in errors]
    assert target.read_bytes() == source.read_bytes()
    assert sorted(p.name for p in target.parent.iterdir()) == ["blob.bin"]  # no partial file left
