"""One API for local paths and ``s3://`` URIs.

Steps read inputs and write outputs through these functions only, so a step runs the same
against a folder on disk (tests, laptops) and against the S3 server (local stack, cluster).

Outputs are committed, never written in place: :func:`staged_output` hands the step a local
scratch folder and publishes it only when the step succeeds. On S3 the objects are uploaded
first and a ``_SUCCESS`` manifest is written last; readers call :func:`require_complete`, so a
crash mid-upload leaves nothing a reader would take for a result, and a retry starts by
clearing the prefix.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import tempfile
import uuid
from collections.abc import Callable, Iterator
from functools import lru_cache
from pathlib import Path
from typing import Any

from tasks.lib.errors import StepError

SUCCESS_MARKER = "_SUCCESS"
# Folder transfers (s3fs): files in flight at once, and the part size of a multipart upload (a
# file under two parts is sent in one request). Memory: at most FILES_AT_ONCE x 2 parts (128 MB).
FILES_AT_ONCE, PART_BYTES, MAX_PARTS = 8, 8 << 20, 10_000
MISSING_CODES = ("404", "NoSuchKey", "NotFound", "NoSuchBucket")
DENIED_CODES = ("403", "AccessDenied", "InvalidAccessKeyId", "SignatureDoesNotMatch")


class StorageUnavailable(RuntimeError):
    """S3 failed to answer (5xx, throttling, a dropped connection): exit 1, the task retries."""


class MissingObject(StepError):
    """No such object or bucket: bad input (exit 2), unless a reader finds its manifest replaced."""


def s3_error(uri: str, action: str, exc: Exception) -> Exception:
    """What an S3 failure means for the step: a missing object or a refused credential is bad
    input (exit 2: a retry reads the same nothing); anything else is transient (retried)."""
    response = getattr(exc, "response", None) or {}
    code = str(response.get("Error", {}).get("Code", "")) or type(exc).__name__
    if code in MISSING_CODES:
        return MissingObject(f"{uri}: no such {'bucket' if code == 'NoSuchBucket' else 'object'} ({action})")
    if code in DENIED_CODES:
        return StepError(f"{uri}: access denied ({code}) on {action}: check the step's S3 credentials")
    status = response.get("ResponseMetadata", {}).get("HTTPStatusCode", "")
    return StorageUnavailable(f"{uri}: S3 {action} failed ({code} {status}): transient, the task retries".strip())


@contextlib.contextmanager
def s3_call(uri: str, action: str) -> Iterator[None]:
    from botocore.exceptions import BotoCoreError, ClientError

    try:
        yield
    except (ClientError, BotoCoreError) as exc:
        raise s3_error(uri, action, exc) from None


@contextlib.contextmanager
def s3fs_call(uri: str, action: str) -> Iterator[None]:
    """s3fs's failures, classified as :func:`s3_call` classifies boto3's. s3fs turns botocore's
    errors into OSErrors (``FileNotFoundError``, ``PermissionError``, ``OSError(EREMOTEIO)``)
    whose cause is the original, so the original decides where there is one."""
    from aiohttp import ClientError as HTTPError
    from botocore.exceptions import BotoCoreError, ClientError

    try:
        yield
    except (OSError, BotoCoreError, ClientError, HTTPError) as exc:
        if isinstance(exc, OSError) and str(exc.filename or "").startswith("/"):
            raise  # a local file's failure (a full disk, a permission): not S3's, not to be renamed
        chain: list[BaseException] = [exc]
        while (cause := chain[-1].__cause__ or chain[-1].__context__) is not None and len(chain) < 8:
            chain.append(cause)
        original = next((e for e in chain if isinstance(e, ClientError | BotoCoreError)), None)
        if original is not None:
            raise s3_error(uri, action, original) from None  # type: ignore[arg-type]
        if isinstance(exc, FileNotFoundError):
            raise MissingObject(f"{uri}: no such object ({action})") from None
        if isinstance(exc, PermissionError):
            raise StepError(f"{uri}: access denied on {action}: check the step's S3 credentials") from None
        raise StorageUnavailable(f"{uri}: S3 {action} failed ({type(exc).__name__}: {exc}): "
                                 "transient, the task retries") from None


def is_s3(uri: str) -> bool:
    return uri.startswith("s3://")


def join(uri: str, *parts: str) -> str:
    """Join path segments onto a URI with ``/`` (also for local paths)."""
    out = uri.rstrip("/")
    for part in parts:
        out = f"{out}/{part.strip('/')}"
    return out


def sibling(uri: str, name: str) -> str:
    """The file ``name`` in the same folder as ``uri`` (s3:// or a local path)."""
    return uri.rsplit("/", 1)[0] + "/" + name


def split_s3(uri: str) -> tuple[str, str]:
    """``s3://bucket/key/path`` -> ``("bucket", "key/path")``."""
    if not is_s3(uri):
        raise StepError(f"{uri}: not an s3:// URI")
    bucket, _, key = uri[len("s3://") :].partition("/")
    if not bucket:
        raise StepError(f"{uri}: s3 URI has no bucket")
    return bucket, key


@lru_cache(maxsize=1)
def s3_client() -> Any:
    """A boto3 S3 client for the endpoint in ``AWS_ENDPOINT_URL`` (the local stack) or AWS."""
    import boto3
    from botocore.config import Config

    return boto3.client(
        "s3",
        endpoint_url=os.environ.get("AWS_ENDPOINT_URL") or None,
        config=Config(retries={"max_attempts": 5, "mode": "standard"}, s3={"addressing_style": "path"}),
    )


def s3_filesystem() -> Any:
    """fsspec's S3 filesystem (s3fs) on :func:`s3_client`'s endpoint and credentials, for moving
    a folder: it sends the files concurrently (a folder commits 1.8x and downloads 3.3x faster
    than one boto3 call after another: benchmarks/storage.py), where single small reads stay on
    boto3 (s3fs was 1.2x slower there). fsspec keeps one instance per process and settings (a
    forked child builds its own), so the credentials are part of the settings. Attempts per
    request: botocore's ``AWS_MAX_ATTEMPTS``, default 5."""
    import s3fs

    return s3fs.S3FileSystem(
        key=os.environ.get("AWS_ACCESS_KEY_ID") or None, secret=os.environ.get("AWS_SECRET_ACCESS_KEY") or None,
        client_kwargs={"endpoint_url": os.environ.get("AWS_ENDPOINT_URL") or None},
        config_kwargs={"s3": {"addressing_style": "path"},
                       "retries": {"max_attempts": int(os.environ.get("AWS_MAX_ATTEMPTS") or 5), "mode": "standard"}},
    )


def exists(uri: str) -> bool:
    if not is_s3(uri):
        return Path(uri).exists()
    bucket, key = split_s3(uri)
    from botocore.exceptions import ClientError

    try:
        s3_client().head_object(Bucket=bucket, Key=key)
        return True
    except ClientError as exc:
        if exc.response.get("Error", {}).get("Code") in MISSING_CODES:
            return False
        raise s3_error(uri, "head", exc) from None


def list_files(uri: str) -> list[str]:
    """All files below ``uri`` (recursively), as full URIs, sorted."""
    if not is_s3(uri):
        root = Path(uri)
        if not root.is_dir():
            return []
        return sorted(str(p) for p in root.rglob("*") if p.is_file())
    bucket, key = split_s3(uri)
    prefix = key.rstrip("/") + "/" if key else ""
    found: list[str] = []
    with s3_call(uri, "list"):
        for page in s3_client().get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix):
            found.extend(f"s3://{bucket}/{obj['Key']}" for obj in page.get("Contents", []))
    return sorted(found)


def file_versions(uri: str) -> dict[str, str]:
    """Every file below ``uri`` (recursively) by its path relative to ``uri``, with what changes
    when its content does, without reading it: S3's size and ETag, a local file's size and
    modification time."""
    if not is_s3(uri):
        root = Path(uri)
        return {str(p.relative_to(root)): f"{p.stat().st_size}:{p.stat().st_mtime_ns}"
                for p in sorted(root.rglob("*")) if p.is_file()} if root.is_dir() else {}
    bucket, key = split_s3(uri)
    prefix = key.rstrip("/") + "/" if key else ""
    found: dict[str, str] = {}
    with s3_call(uri, "list"):
        for page in s3_client().get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix):
            found |= {obj["Key"][len(prefix):]: f"{obj['Size']}:{obj.get('ETag', '')}" for obj in page.get("Contents", [])}
    return dict(sorted(found.items()))


def newest_json(root: str, suffix: str, keep: Callable[[dict[str, Any]], bool] = lambda _: True
                ) -> tuple[str, dict[str, Any]] | None:
    """The JSON file ending in ``suffix`` below ``root`` written last (its ``written_at``) among
    those ``keep`` accepts, with its content; None when there is none (every run's reports)."""
    found = {uri: read_json(uri) for uri in list_files(root) if uri.endswith(suffix)}
    kept = {uri: content for uri, content in found.items() if keep(content)}
    if not kept:
        return None
    uri = max(kept, key=lambda u: str(kept[u].get("written_at", "")))
    return uri, kept[uri]


def read_bytes(uri: str) -> bytes:
    if not is_s3(uri):
        try:
            return Path(uri).read_bytes()
        except FileNotFoundError:
            raise StepError(f"{uri}: no such file") from None
    bucket, key = split_s3(uri)
    with s3_call(uri, "read"):
        body: bytes = s3_client().get_object(Bucket=bucket, Key=key)["Body"].read()
    return body


def iter_range(uri: str, start: int, end: int, chunk_bytes: int = 1 << 22) -> Iterator[bytes]:
    """Bytes ``[start, end)`` of a file in chunks of at most ``chunk_bytes`` (one S3 ranged GET,
    streamed): a reader holds a chunk at a time, not the range."""
    if end <= start:
        return
    if not is_s3(uri):
        if not Path(uri).is_file():
            raise StepError(f"{uri}: no such file")
        with Path(uri).open("rb") as fh:
            fh.seek(start)
            left = end - start
            while left > 0 and (chunk := fh.read(min(chunk_bytes, left))):
                left -= len(chunk)
                yield chunk
        return
    bucket, key = split_s3(uri)
    received = 0
    with s3_call(uri, "ranged read"):
        body = s3_client().get_object(Bucket=bucket, Key=key, Range=f"bytes={start}-{end - 1}")["Body"]
        for chunk in body.iter_chunks(chunk_bytes):
            received += len(chunk)
            yield chunk
    if received != end - start:
        raise StorageUnavailable(f"{uri}: asked bytes {start}-{end - 1}, got {received} bytes")


def read_json(uri: str) -> Any:
    try:
        return json.loads(read_bytes(uri))
    except json.JSONDecodeError as exc:
        raise StepError(f"{uri}: invalid JSON ({exc.msg} at line {exc.lineno})") from None


def write_bytes(uri: str, data: bytes) -> None:
    """Write one small object in place (markers, metadata; results go through staged_output)."""
    if is_s3(uri):
        bucket, key = split_s3(uri)
        with s3_call(uri, "write"):
            s3_client().put_object(Bucket=bucket, Key=key, Body=data)
        return
    Path(uri).parent.mkdir(parents=True, exist_ok=True)
    Path(uri).write_bytes(data)


def upload(local_path: Path, uri: str) -> None:
    bucket, key = split_s3(uri)
    with s3_call(uri, "upload"):
        s3_client().upload_file(str(local_path), bucket, key)


def download(uri: str, local_path: Path) -> Path:
    """Copy one file to ``local_path`` (no copy for a local source: its path is returned)."""
    if not is_s3(uri):
        if not Path(uri).is_file():
            raise StepError(f"{uri}: no such file")
        return Path(uri)
    bucket, key = split_s3(uri)
    local_path.parent.mkdir(parents=True, exist_ok=True)
    # Processes of one node may fetch the same file at once (ranks resuming one checkpoint).
    # boto3 names its temporary file with Python's `random`, which training seeds alike on every
    # rank: same name, and the second rename found nothing. A per-process name, then one
    # atomic replace (the same content either way).
    partial = local_path.with_name(f".{local_path.name}.{os.getpid()}.part")
    try:
        with s3_call(uri, "download"):
            s3_client().download_file(bucket, key, str(partial))
        os.replace(partial, local_path)
    finally:
        partial.unlink(missing_ok=True)
    return local_path


def read_manifest(uri: str) -> dict[str, Any]:
    """The ``_SUCCESS`` manifest of a committed output folder (files, sizes, sha256)."""
    require_complete(uri)
    manifest: dict[str, Any] = read_json(join(uri, SUCCESS_MARKER))
    return manifest


def download_tree(uri: str, local_dir: Path, manifest: dict[str, Any] | None = None) -> Path:
    """Copy a committed output folder to ``local_dir`` (a local folder is used in place), and
    check every file against its ``_SUCCESS`` manifest (``manifest``: already read by the
    caller): what is read is what was committed. A file that differs is read again once: if
    the manifest changed meanwhile (or is gone), a writer is replacing the output, which is
    transient (:class:`StorageUnavailable`: the task retries and reads the new one whole; the
    caller keeps no half of either); if the same manifest still disagrees, the output was
    tampered with or corrupted: bad input (exit 2, no retry)."""
    manifest = manifest if manifest is not None else read_manifest(uri)
    root = Path(uri) if not is_s3(uri) else local_dir
    names = manifest_names(uri, manifest, root)
    differing = _fetch_and_check(uri, names, root, manifest)
    if differing:  # read again: a writer replacing the output meanwhile, or a lasting difference
        try:
            reread = read_manifest(uri)
        except StepError:
            reread = None
        if reread != manifest:
            raise StorageUnavailable(f"{join(uri, differing[0])}: missing or differs from its {SUCCESS_MARKER} manifest, "
                                     "which changed meanwhile (the output is being replaced)")
        differing = _fetch_and_check(uri, names, root, manifest)
        if differing:
            raise StepError(f"{join(uri, differing[0])}: missing or differs from its {SUCCESS_MARKER} manifest "
                            "(size or sha256), read twice: a tampered or corrupted output")
    return root


def _fetch_and_check(uri: str, names: list[str], root: Path, manifest: dict[str, Any]) -> list[str]:
    """Download ``names`` into ``root`` (an S3 output; a local one is read in place) and return
    those missing or differing from ``manifest``."""
    if is_s3(uri):
        root.mkdir(parents=True, exist_ok=True)
        try:  # ``root`` is the caller's own folder: no other writer
            with s3fs_call(uri, "download"):  # each file streamed to disk: no part held in memory
                s3_filesystem().get([join(uri, name) for name in names], [str(root / name) for name in names],
                                    batch_size=FILES_AT_ONCE, max_concurrency=1)
        except MissingObject:
            # a listed file is gone, and fsspec cancelled the transfers in flight: those are
            # fetched one by one, so the mismatches below name only what is really gone
            for name in manifest_mismatches(root, manifest):
                with contextlib.suppress(MissingObject):
                    download(join(uri, name), root / name)
    return manifest_mismatches(root, manifest)


def manifest_names(uri: str, manifest: dict[str, Any], root: Path) -> list[str]:
    """The manifest's file names, each a relative path inside ``root``: an absolute name, a
    ``..`` or one that resolves outside (a symlink) would write or read elsewhere (a ``.pth``
    file in the venv runs code in every later step), so it is bad input, refused before any
    file is written."""
    names = list(manifest.get("files", {}))
    inside = root.resolve()
    for name in names:
        parts = Path(name).parts
        if not name or Path(name).is_absolute() or ".." in parts or "\\" in name:
            raise StepError(f"{join(uri, SUCCESS_MARKER)}: file name {name!r} is not a path inside the output folder")
        if not (root / name).resolve().is_relative_to(inside):
            raise StepError(f"{join(uri, SUCCESS_MARKER)}: file name {name!r} resolves outside the output folder")
    return names


def manifest_mismatches(root: Path, manifest: dict[str, Any]) -> list[str]:
    """The manifest's files missing under ``root`` or differing in size or sha256."""
    return [name for name, expected in manifest.get("files", {}).items()
            if not (path := root / name).is_file() or path.stat().st_size != expected["bytes"]
            or sha256_file(path) != expected["sha256"]]


def delete_tree(uri: str) -> None:
    if not is_s3(uri):
        shutil.rmtree(uri, ignore_errors=True)
        return
    bucket, _ = split_s3(uri)
    keys = [split_s3(u)[1] for u in list_files(uri)]
    for start in range(0, len(keys), 1000):
        batch = [{"Key": k} for k in keys[start : start + 1000]]
        s3_client().delete_objects(Bucket=bucket, Delete={"Objects": batch, "Quiet": True})


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def manifest_of(local_dir: Path) -> dict[str, Any]:
    files = sorted(p for p in local_dir.rglob("*") if p.is_file())
    return {
        "files": {
            str(p.relative_to(local_dir)): {"bytes": p.stat().st_size, "sha256": sha256_file(p)}
            for p in files
        }
    }


def commit_dir(local_dir: Path, uri: str, write_once: bool = False) -> None:
    """Publish ``local_dir`` at ``uri``, replacing what was there, manifest last.

    ``write_once``: a content-addressed output (the same name always holds the same bytes) is
    never deleted or replaced, since other runs may be reading it: a complete one is kept as
    is, an incomplete one is completed by uploading the same files again."""
    if write_once and exists(join(uri, SUCCESS_MARKER)):
        return
    manifest = json.dumps(manifest_of(local_dir), indent=1, sort_keys=True).encode()
    if is_s3(uri):
        if not write_once:
            delete_tree(uri)  # leftovers of an earlier, failed attempt
        files = sorted(p for p in local_dir.rglob("*") if p.is_file())
        largest = max((p.stat().st_size for p in files), default=0)
        with s3fs_call(uri, "upload"):
            s3_filesystem().put([str(p) for p in files], [join(uri, p.relative_to(local_dir).as_posix()) for p in files],
                                batch_size=FILES_AT_ONCE, max_concurrency=1,
                                chunksize=max(PART_BYTES, -(-largest // MAX_PARTS)))
        write_bytes(join(uri, SUCCESS_MARKER), manifest)  # last: readers take only a complete output
        return
    (local_dir / SUCCESS_MARKER).write_bytes(manifest)
    final = Path(uri)
    final.parent.mkdir(parents=True, exist_ok=True)
    if write_once:
        try:
            local_dir.rename(final)  # atomic; fails if another writer got there first
        except OSError:
            if not (final / SUCCESS_MARKER).exists():
                raise
        return
    if final.exists():
        # rename the old result aside first: os.replace cannot replace a non-empty folder
        old = final.with_name(f".{final.name}.old-{uuid.uuid4().hex[:8]}")
        final.rename(old)
        shutil.move(str(local_dir), final)
        shutil.rmtree(old, ignore_errors=True)
    else:
        shutil.move(str(local_dir), final)


def add_files(local_dir: Path, uri: str) -> list[str]:
    """Add ``local_dir``'s files to the output at ``uri`` (committed or not there yet), never
    changing a file already in it: the new files first, then the ``_SUCCESS`` manifest listing old
    and new (the output stays complete throughout for its readers; a bare marker, as other
    ingestion jobs write, is left as it is). A name already there with the same bytes is skipped
    (a retried or repeated addition adds nothing); with other bytes it is refused. Returns the
    names added."""
    files = sorted(p for p in local_dir.iterdir() if p.is_file())
    ours = {p.name: sha256_file(p) for p in files}  # each file hashed once
    manifest: dict[str, Any] | None
    if exists(join(uri, SUCCESS_MARKER)):
        manifest = marker_manifest(uri)
    else:
        unmarked = {name.rsplit("/", 1)[-1]: name for name in list_files(uri)}
        if any(ours.get(name) != existing_sha256(found) for name, found in unmarked.items()):
            # another writer's, unfinished or failed: never deleted, never completed by us
            raise StepError(f"{uri}: files but no {SUCCESS_MARKER} marker: a folder still being written, or whose "
                            "writer failed, is left alone (finish or remove it, then add again)")
        if unmarked:  # our own earlier attempt, which died before the marker: completed, marker last
            manifest = {"files": {}}
        else:
            with staged_output(uri, write_once=True) as staging:  # a writer committing first wins
                for path in files:
                    shutil.copy2(path, staging / path.name)
            manifest = marker_manifest(uri)
            if manifest is not None and all(manifest["files"].get(n, {}).get("sha256") == h for n, h in ours.items()):
                return list(ours)
    listed: dict[str, Any] = manifest["files"] if manifest else {}
    added: list[str] = []
    for path in files:
        target, entry = join(uri, path.name), {"bytes": path.stat().st_size, "sha256": ours[path.name]}
        there = listed.get(path.name, {}).get("sha256") or (existing_sha256(target) if exists(target) else None)
        if there is not None:
            if there != entry["sha256"]:
                raise StepError(f"{target}: already there with other content: a committed file is never replaced")
            if path.name not in listed and manifest is not None:  # landed by an attempt that died before the manifest
                listed[path.name] = entry
                added.append(path.name)
            continue
        if is_s3(uri):
            upload(path, target)
        else:  # a rename on one filesystem: a reader sees the whole file or none
            staged = Path(uri) / f".{path.name}.{uuid.uuid4().hex[:8]}"
            shutil.copy2(path, staged)
            staged.rename(target)
        listed[path.name] = entry
        added.append(path.name)
    if added and manifest is not None:
        data = json.dumps({**manifest, "files": listed}, indent=1, sort_keys=True).encode()
        if is_s3(uri):
            write_bytes(join(uri, SUCCESS_MARKER), data)
        else:
            staged = Path(uri) / f".{SUCCESS_MARKER}.{uuid.uuid4().hex[:8]}"
            staged.write_bytes(data)
            staged.replace(Path(uri) / SUCCESS_MARKER)
    return added


def marker_manifest(uri: str) -> dict[str, Any] | None:
    """The ``_SUCCESS`` manifest of ``uri``, or None for a bare marker (empty, or not ours)."""
    try:
        found = json.loads(read_bytes(join(uri, SUCCESS_MARKER)) or b"null")
    except (ValueError, UnicodeDecodeError):
        return None
    return found if isinstance(found, dict) and isinstance(found.get("files"), dict) else None


def existing_sha256(uri: str) -> str:
    """A stored file's sha256, read a chunk at a time."""
    if not is_s3(uri):
        return sha256_file(Path(uri))
    digest = hashlib.sha256()
    bucket, key = split_s3(uri)
    with s3_call(uri, "read"):
        for chunk in s3_client().get_object(Bucket=bucket, Key=key)["Body"].iter_chunks(1 << 22):
            digest.update(chunk)
    return digest.hexdigest()


def require_complete(uri: str) -> None:
    """Fail unless ``uri`` is a committed output (its ``_SUCCESS`` manifest exists)."""
    if not exists(join(uri, SUCCESS_MARKER)):
        raise StepError(f"{uri}: not a complete step output (no {SUCCESS_MARKER} marker)")


@contextlib.contextmanager
def staged_output(uri: str, write_once: bool = False) -> Iterator[Path]:
    """A local scratch folder that becomes ``uri`` only if the ``with`` body succeeds
    (``write_once``: see :func:`commit_dir`)."""
    # For local outputs stage beside the target, so the final move is a rename on one filesystem.
    parent = None if is_s3(uri) else Path(uri).resolve().parent
    if parent is not None:
        parent.mkdir(parents=True, exist_ok=True)
    scratch = Path(tempfile.mkdtemp(prefix=".staging-", dir=parent))
    scratch.chmod(0o755)  # mkdtemp's 0700 would become the published folder's mode
    try:
        yield scratch
        commit_dir(scratch, uri, write_once)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


@contextlib.contextmanager
def scratch() -> Iterator[Path]:
    """A private temporary folder for a step's downloads, removed however the step ends."""
    with tempfile.TemporaryDirectory(prefix="step-scratch-") as path:
        yield Path(path)
