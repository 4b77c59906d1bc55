"""The storage path, side by side on the same S3 (the local stack's SeaweedFS): ``tasks/lib/storage.py``
as the steps use it (folders through s3fs, small reads through boto3), boto3 one file after another
(how folders moved before), and plain fsspec/s3fs calls.

    .venvs/runtime/bin/python -m stack up && set -a && source .stack/stack.env && set +a
    .venvs/runtime/bin/python benchmarks/storage.py [--rounds 3]

Work, as the steps do it: commit an output folder (a few large files, like a tokenized dataset's
shards, and many small ones, like a Triton repository fragment); download it again and check it
against its manifest (the train step's node-local copy); read many small objects one by one
(manifests, ``trainer.json``, markers); list a prefix. Each variant's best of ``--rounds``
interleaved rounds. Answers issue 27's "replace only where the result is at least as fast".
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))

from tasks.lib import storage  # noqa: E402

LARGE, LARGE_BYTES, SMALL, SMALL_BYTES = 4, 8 << 20, 200, 4 << 10
Work = Callable[[], object]


def make_folder(root: Path) -> Path:
    folder = root / "output"
    folder.mkdir(parents=True)
    for i in range(LARGE):
        (folder / f"shard-{i:05d}.bin").write_bytes(os.urandom(LARGE_BYTES))
    for i in range(SMALL):
        (folder / "small" / f"{i:04d}.json").parent.mkdir(exist_ok=True)
        (folder / "small" / f"{i:04d}.json").write_bytes(os.urandom(SMALL_BYTES))
    return folder


def s3fs_filesystem() -> Any:
    import s3fs

    return s3fs.S3FileSystem(client_kwargs={"endpoint_url": os.environ["AWS_ENDPOINT_URL"]},
                             config_kwargs={"s3": {"addressing_style": "path"}})


def timed(work: Callable[[], object]) -> float:
    started = time.perf_counter()
    work()
    return time.perf_counter() - started


VARIANTS = ("storage.py", "boto3 serial", "s3fs")


def variants(ours: str, serial: str, theirs: str, folder: Path, tmp: Path, fs: Any) -> dict[str, tuple[Work, ...]]:
    """Per work: (storage.py's, boto3 one file at a time, s3fs's), on output folders at ``ours``,
    ``serial`` and ``theirs``."""
    manifest = storage.manifest_of(folder)
    smalls = [f"small/{i:04d}.json" for i in range(SMALL)]
    files = sorted(p for p in folder.rglob("*") if p.is_file())

    def serial_commit() -> None:
        for path in files:
            storage.upload(path, storage.join(serial, path.relative_to(folder).as_posix()))
        storage.write_bytes(storage.join(serial, storage.SUCCESS_MARKER), json.dumps(manifest).encode())

    def serial_download() -> None:
        local = tmp / f"serial-{uuid.uuid4().hex}"
        for name in manifest["files"]:
            storage.download(storage.join(serial, name), local / name)
        assert not storage.manifest_mismatches(local, manifest)
        shutil.rmtree(local)

    def fsspec_commit() -> None:
        fs.put(str(folder) + "/", theirs, recursive=True)
        fs.pipe(f"{theirs}/{storage.SUCCESS_MARKER}", json.dumps(manifest).encode())

    def fsspec_download() -> None:
        local = tmp / f"fsspec-{uuid.uuid4().hex}"
        fs.get(theirs + "/", str(local) + "/", recursive=True)
        assert not storage.manifest_mismatches(local, manifest)
        shutil.rmtree(local)

    def ours_download() -> None:
        local = tmp / f"ours-{uuid.uuid4().hex}"
        storage.download_tree(ours, local)
        shutil.rmtree(local)

    return {
        "commit a folder (4 x 8 MB + 200 x 4 KB)": (lambda: storage.commit_dir(folder, ours), serial_commit,
                                                    fsspec_commit),
        "download it, checked against its manifest": (ours_download, serial_download, fsspec_download),
        "read 200 small objects one by one": (lambda: [storage.read_bytes(storage.join(ours, n)) for n in smalls],
                                              lambda: [storage.read_bytes(storage.join(serial, n)) for n in smalls],
                                              lambda: [fs.cat_file(f"{theirs}/{n}") for n in smalls]),
        "list the folder": (lambda: storage.list_files(ours), lambda: storage.list_files(serial),
                            lambda: fs.find(theirs, refresh=True)),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    if not os.environ.get("AWS_ENDPOINT_URL"):
        raise SystemExit("AWS_ENDPOINT_URL is not set: source .stack/stack.env (see the docstring)")
    fs = s3fs_filesystem()
    best: dict[tuple[str, str], float] = {}
    with tempfile.TemporaryDirectory(prefix="bench-storage-") as tmp:
        folder = make_folder(Path(tmp))
        for _ in range(args.rounds):
            ours, serial = (f"s3://pipeline/bench/{uuid.uuid4().hex}/out" for _ in range(2))
            theirs = f"pipeline/bench/{uuid.uuid4().hex}/out"
            for name, works in variants(ours, serial, theirs, folder, Path(tmp), fs).items():
                for variant, work in zip(VARIANTS, works, strict=True):
                    best[name, variant] = min(best.get((name, variant), float("inf")), timed(work))
            storage.delete_tree(ours)
            storage.delete_tree(serial)
            fs.rm(theirs, recursive=True)
    print(f"\nbest of {args.rounds} rounds, {os.cpu_count()} CPUs, SeaweedFS on 127.0.0.1")
    print(f"{'work':<44}{'storage.py s':>14}{'boto3 serial s':>16}{'s3fs s':>10}{'ours / serial':>15}"
          f"{'ours / s3fs':>13}")
    for name in dict.fromkeys(name for name, _ in best):
        ours_s, serial_s, s3fs_s = (best[name, variant] for variant in VARIANTS)
        print(f"{name:<44}{ours_s:>14.3f}{serial_s:>16.3f}{s3fs_s:>10.3f}{ours_s / serial_s:>15.2f}"
              f"{ours_s / s3fs_s:>13.2f}")


if __name__ == "__main__":
    main()
