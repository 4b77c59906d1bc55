"""The DVC data registry: a git repo whose tags name data versions, data on an S3 remote.

Each logical date gets one tag (``data-YYYY-MM-DD``) on a commit whose ``.dvc`` file points at
that snapshot in the remote, so a backfill or an audit reads exactly that version with
``dvc.api.open(path, repo=REGISTRY, rev=TAG)`` or ``dvc pull``. DVC holds a repository lock,
so every operation here runs under an exclusive file lock: parallel runs queue, never collide.

With a ``git_remote`` (cluster mode: pods have no shared disk), the registry is a clone that
is fast-forwarded before and pushed, tags included, after each new version; a push that loses
a race to another run fails the step, and its retry starts from the newer history.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tasks.lib.errors import StepError
from tasks.lib.step import log

SNAPSHOT_PATH = "data/snapshot.jsonl"
VERSION_PATH = "data/version.json"


@dataclass(frozen=True)
class DataVersion:
    tag: str
    content_hash: str
    records: int
    bytes: int
    commit: str
    created: bool  # False when the tag already existed with the same content (a retry)


class Registry:
    def __init__(self, path: Path, remote_url: str, git_remote: str = "") -> None:
        self.path = path
        self.remote_url = remote_url
        self.git_remote = git_remote

    def _run(self, *argv: str) -> str:
        # DVC's site cache defaults to /var/tmp/dvc, read-only in a pod: keep it beside our temp files
        env = {**os.environ, "DVC_SITE_CACHE_DIR": os.environ.get("DVC_SITE_CACHE_DIR")
               or str(Path(tempfile.gettempdir()) / "dvc-site-cache")}
        proc = subprocess.run(argv, cwd=self.path, capture_output=True, text=True, env=env)
        if proc.returncode != 0:
            detail = (proc.stderr or proc.stdout).strip().splitlines()
            raise RuntimeError(f"{' '.join(argv[:3])} failed in {self.path}: {detail[-1] if detail else proc.returncode}")
        return proc.stdout.strip()

    def git(self, *args: str) -> str:
        return self._run("git", *args)

    def dvc(self, *args: str) -> str:
        return self._run(sys.executable, "-m", "dvc", *args)

    @contextlib.contextmanager
    def locked(self) -> Iterator[None]:
        self.path.mkdir(parents=True, exist_ok=True)
        with (self.path.parent / f".{self.path.name}.lock").open("w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(lock, fcntl.LOCK_UN)

    def ensure(self) -> None:
        """Create the repo and its remote once; (re)point the remote at this environment's S3."""
        if self.git_remote:
            self._sync_from_git_remote()
        if not (self.path / ".dvc").is_dir():
            if not (self.path / ".git").is_dir():
                self.git("init", "-q", "-b", "main")
            self.git("config", "user.name", "llm-pipeline")
            self.git("config", "user.email", "llm-pipeline@localhost")
            self.dvc("init", "-q")
            with self.config("repo") as conf:
                conf["core"].update(autostage="true", remote="store",
                                    analytics="false")  # whoever runs DVC in this registry (tasks/__init__.py)
                conf["remote"]["store"] = {"url": self.remote_url}
            self.git("add", "-A")
            self.git("commit", "-q", "-m", "Initialize the data registry")
        # the endpoint is environment-specific (local stack vs cloud): keep it in the git-ignored
        # local config; the keys come from AWS_* in the environment
        endpoint = os.environ.get("AWS_ENDPOINT_URL")
        if endpoint:
            with self.config("local") as conf:
                conf["remote"].setdefault("store", {})["endpointurl"] = endpoint

    @contextlib.contextmanager
    def config(self, level: str) -> Iterator[dict[str, Any]]:
        """DVC's own config editor (what ``dvc config`` and ``dvc remote`` run, with its schema
        checked on save) in this process: a ``dvc`` subprocess spends ~1.2 s starting DVC."""
        from dvc.config import Config

        with Config(dvc_dir=str(self.path / ".dvc")).edit(level) as conf:
            yield conf

    def _sync_from_git_remote(self) -> None:
        if not (self.path / ".git").is_dir():
            self._run("git", "clone", "-q", self.git_remote, ".")
            self.git("config", "user.name", "llm-pipeline")
            self.git("config", "user.email", "llm-pipeline@localhost")
        self.git("fetch", "-q", "--tags", "origin")
        if self.git("ls-remote", "--heads", "origin", "main"):
            self.git("checkout", "-q", "-B", "main", "origin/main")

    def _publish(self, tag: str) -> None:
        if self.git_remote:
            self.git("push", "-q", "origin", "main", tag)

    def _republish(self, tag: str) -> None:
        """Make sure both remotes hold an existing version: an earlier attempt may have died
        between its pushes. The data pushed is the tag's own ``.dvc`` (not whatever HEAD holds
        now), and the tag itself goes to the git remote."""
        dvc_file = f"{SNAPSHOT_PATH}.dvc"
        self.git("checkout", "-q", tag, "--", dvc_file)
        try:
            self.dvc("push", "-q", "-r", "store", dvc_file)
        finally:
            self.git("checkout", "-q", "HEAD", "--", dvc_file)
        if self.git_remote:
            self.git("push", "-q", "origin", f"refs/tags/{tag}")

    def tag_version(self, tag: str) -> dict[str, object] | None:
        if not self.git("tag", "--list", tag):
            return None
        loaded: dict[str, object] = json.loads(self.git("show", f"{tag}:{VERSION_PATH}"))
        return loaded

    def remote_object(self, tag: str) -> str:
        """The remote's URI of the snapshot ``tag`` versions (DVC 3's ``files/md5/xx/...`` layout)."""
        import yaml

        outs = yaml.safe_load(self.git("show", f"{tag}:{SNAPSHOT_PATH}.dvc"))["outs"]
        md5 = str(outs[0]["md5"])
        return f"{self.remote_url.rstrip('/')}/files/md5/{md5[:2]}/{md5[2:]}"

    def restore(self, tag: str, target: Path) -> tuple[DataVersion, dict[str, object]]:
        """Copy the snapshot versioned as ``tag`` to ``target`` (from the DVC cache, else pulled
        from the remote), leaving the registry's workspace as it was; a tag that does not exist
        is bad input."""
        dvc_file = f"{SNAPSHOT_PATH}.dvc"
        with self.locked():
            self.ensure()
            version = self.tag_version(tag)
            if version is None:
                raise StepError(f"data version {tag}: no such tag in the DVC registry {self.git_remote or self.path}")
            self.git("checkout", "-q", tag, "--", dvc_file)
            try:
                self.dvc("pull", "-q", "-r", "store", dvc_file)  # a failure: retried (an outage, or gone for good)
                shutil.copyfile(self.path / SNAPSHOT_PATH, target)
            finally:
                self.git("checkout", "-q", "HEAD", "--", dvc_file)
                try:  # HEAD's data back in the workspace, where the cache has it (a fresh clone's may not)
                    if (self.path / dvc_file).exists():
                        self.dvc("checkout", "-q", "-f", dvc_file)
                except RuntimeError as exc:  # harmless: the next snapshot is copied over it and added
                    log.info("registry workspace left with %s's data: %s", tag, exc)
            return self._version(tag, version, created=False), version

    def commit_snapshot(self, tag: str, snapshot: Path, version: dict[str, object]) -> DataVersion:
        """Version ``snapshot`` under ``tag``; a retry with the same content is a no-op."""
        with self.locked():
            self.ensure()
            existing = self.tag_version(tag)
            if existing is not None:
                if existing["content_hash"] != version["content_hash"]:
                    raise StepError(
                        f"data version {tag} already exists with content {existing['content_hash'][:12]}"  # type: ignore[index]
                        f", this snapshot is {str(version['content_hash'])[:12]}: raw data changed under an existing tag"
                    )
                log.info("data version %s already exists with the same content: reusing it", tag)
                self._republish(tag)
                return self._version(tag, existing, created=False)
            target = self.path / SNAPSHOT_PATH
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(snapshot, target)
            (self.path / VERSION_PATH).write_text(json.dumps(version, indent=1, sort_keys=True) + "\n")
            self.dvc("add", "-q", SNAPSHOT_PATH)
            self.dvc("push", "-q", "-r", "store")
            self.git("add", "-A")
            if self.git("status", "--porcelain"):
                self.git("commit", "-q", "-m", f"Data version {tag}")
            self.git("tag", "-a", tag, "-m", f"snapshot {version['content_hash']}")
            self._publish(tag)
            return self._version(tag, version, created=True)

    def _version(self, tag: str, version: dict[str, object], created: bool) -> DataVersion:
        return DataVersion(
            tag=tag,
            content_hash=str(version["content_hash"]),
            records=int(version["records"]),  # type: ignore[call-overload]
            bytes=int(version["bytes"]),  # type: ignore[call-overload]
            commit=self.git("rev-list", "-n", "1", tag),
            created=created,
        )
