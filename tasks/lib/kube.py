"""The Kubernetes API as the deploy step uses it: plain HTTPS with the pod's service account, and
a ``coordination.k8s.io`` Lease as the one-deployer-at-a-time lock.

The lock is a Lease (the object Kubernetes' own leader election uses), taken and renewed by
updates conditioned on ``resourceVersion``: of two deployers that read it free, the API server
accepts one update and answers the other 409, so it is never held twice. Its holder renews it
every third of ``leaseDurationSeconds`` from a thread; one whose pod died stops renewing and
the Lease is free again that long after (not an hour). A holder whose last good write is that
old (it was paused, the API server unreachable) or that finds it taken stops before touching
serving again.
"""

from __future__ import annotations

import datetime as dt
import json
import os
import socket
import ssl
import threading
import time
import urllib.error
import urllib.request
import uuid
from pathlib import Path
from typing import Any

from tasks.lib.errors import StepError, Terminated, first_line
from tasks.lib.step import log

SERVICE_ACCOUNT = Path("/var/run/secrets/kubernetes.io/serviceaccount")


class KubeError(RuntimeError):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


class KubeApi:
    """The Kubernetes API from inside a pod: the service account's token and CA, plain HTTPS."""

    def __init__(self, server: str, token: str, ca_file: str | None, timeout_s: float = 30.0) -> None:
        self.server, self.token, self.timeout_s = server.rstrip("/"), token, timeout_s
        self.context = ssl.create_default_context(cafile=ca_file) if server.startswith("https") else None

    @classmethod
    def in_cluster(cls) -> KubeApi:
        host, port = os.environ.get("KUBERNETES_SERVICE_HOST"), os.environ.get("KUBERNETES_SERVICE_PORT", "443")
        if not host or not (SERVICE_ACCOUNT / "token").exists():
            raise StepError("SERVING_PLATFORM=kubernetes but this is not a pod (no service account token)")
        return cls(f"https://{host}:{port}", (SERVICE_ACCOUNT / "token").read_text().strip(),
                   str(SERVICE_ACCOUNT / "ca.crt"))

    def call(self, method: str, path: str, body: Any = None, content_type: str = "application/json",
             timeout_s: float | None = None) -> Any:
        request = urllib.request.Request(
            self.server + path, method=method, data=None if body is None else json.dumps(body).encode(),
            headers={"Authorization": f"Bearer {self.token}", "Content-Type": content_type,
                     "Accept": "application/json"})
        try:
            with urllib.request.urlopen(request, timeout=timeout_s or self.timeout_s, context=self.context) as resp:
                return json.loads(resp.read() or b"null")
        except urllib.error.HTTPError as exc:
            raise KubeError(exc.code, f"{method} {path}: {exc.code} {error_message(exc)}") from None


def error_message(exc: urllib.error.HTTPError) -> str:
    """The API server's ``Status`` message, or the start of whatever a proxy in front answered."""
    body = exc.read()
    try:
        return str(json.loads(body).get("message", exc.reason))
    except (ValueError, AttributeError):
        return body.decode(errors="replace")[:200] or str(exc.reason)


def micro_time(at: float) -> str:
    """A Lease's ``MicroTime``: RFC 3339 with microseconds, UTC."""
    return dt.datetime.fromtimestamp(at, dt.UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


class LeaseLost(StepError):
    """The Lease may not be ours any more: this deployer must not touch serving again."""


class Lease:
    """One ``coordination.k8s.io/v1`` Lease held by at most one deployer (see the module docstring).

    As client-go's leader election: whether a holder is alive is judged on this process's own
    clock (how long its record has stayed unchanged since we first saw it), never by comparing
    its ``renewTime`` with our wall clock, so skewed clocks between nodes do not matter; and a
    holder counts the Lease as its own only until ``duration`` after the start of its last
    successful write (less a margin), whatever its renewal thread is doing (paused, failing)."""

    def __init__(self, api: KubeApi, namespace: str, name: str, duration_s: int, poll_s: float = 5.0) -> None:
        self.api, self.name, self.duration_s, self.poll_s = api, name, int(duration_s), poll_s
        self.collection = f"/apis/coordination.k8s.io/v1/namespaces/{namespace}/leases"
        self.identity = f"{socket.gethostname()}/{os.getpid()}/{uuid.uuid4().hex[:8]}"
        self.held: dict[str, Any] | None = None  # the Lease as our last write left it
        self.valid_until = 0.0  # monotonic: ours for sure until then
        self.lost = ""  # why it is no longer ours ("" while it is)
        self._seen: tuple[str, str, float] = ("", "", 0.0)  # another holder's record, when we first saw it
        self._stop = threading.Event()
        self._renewer: threading.Thread | None = None
        self._call_timeout_s = max(1.0, duration_s / 6)  # a hung call must not outlast a renewal period

    def _call(self, method: str, path: str, body: Any = None) -> Any:
        return self.api.call(method, path, body, timeout_s=self._call_timeout_s)

    def _read(self) -> dict[str, Any] | None:
        try:
            found: dict[str, Any] = self._call("GET", f"{self.collection}/{self.name}")
            return found
        except KubeError as exc:
            if exc.status == 404:
                return None
            raise

    def _spec(self, transitions: int, acquired: str) -> dict[str, Any]:
        return {"holderIdentity": self.identity, "leaseDurationSeconds": self.duration_s,
                "acquireTime": acquired, "renewTime": micro_time(time.time()), "leaseTransitions": transitions}

    def _wrote(self, lease: dict[str, Any], started: float) -> None:
        """Our write that began at ``started`` (monotonic) succeeded: ours until then + duration."""
        self.held = lease
        self.valid_until = started + self.duration_s * 0.8  # a margin for the call's own time

    def free(self, lease: dict[str, Any]) -> bool:
        """Nobody holds it, or its holder's record has not changed for ``leaseDurationSeconds``
        of our own clock since we first saw it (it stopped renewing)."""
        spec = lease.get("spec", {})
        holder, renewed = str(spec.get("holderIdentity") or ""), str(spec.get("renewTime") or "")
        if not holder:
            return True
        now = time.monotonic()
        if self._seen[:2] != (holder, renewed):
            self._seen = (holder, renewed, now)
        return now - self._seen[2] > float(spec.get("leaseDurationSeconds", self.duration_s))

    def try_acquire(self) -> str:
        """Take the Lease if it is free: "" when taken, else who holds it."""
        started = time.monotonic()
        current = self._read()
        try:
            if current is None:
                body = {"apiVersion": "coordination.k8s.io/v1", "kind": "Lease",
                        "metadata": {"name": self.name, "labels": {"app.kubernetes.io/part-of": "llm-pipeline"}},
                        "spec": self._spec(0, micro_time(time.time()))}
                self._wrote(self._call("POST", self.collection, body), started)
                return ""
            if not self.free(current):
                return str(current["spec"]["holderIdentity"])
            transitions = int(current.get("spec", {}).get("leaseTransitions", 0)) + 1
            # the resourceVersion we read: if another deployer wrote since, the API server says 409
            self._wrote(self._call("PUT", f"{self.collection}/{self.name}",
                                   {**current, "spec": self._spec(transitions, micro_time(time.time()))}), started)
            return ""
        except KubeError as exc:
            if exc.status == 409:  # another deployer created or took it between our read and write
                return "another deployer (it won the race)"
            raise

    def acquire(self) -> None:
        while True:
            holder = self.try_acquire()
            if not holder:
                break
            log.info("waiting for the deploy lock (Lease %s, held by %s)", self.name, holder)
            time.sleep(self.poll_s)
        self.lost = ""
        self._stop.clear()
        self._renewer = threading.Thread(target=self._renew_until_released, name="lease-renewer", daemon=True)
        self._renewer.start()
        log.info("deploy lock taken (Lease %s, as %s)", self.name, self.identity)

    def renew(self) -> None:
        """Write a new ``renewTime``, conditioned on our last write: a 409 means someone else
        wrote the Lease, so it is ours only if it still names us."""
        assert self.held is not None
        started = time.monotonic()
        body = {**self.held, "spec": {**self.held["spec"], "renewTime": micro_time(time.time())}}
        try:
            self._wrote(self._call("PUT", f"{self.collection}/{self.name}", body), started)
        except KubeError as exc:
            if exc.status not in (404, 409):
                raise
            current = self._read()
            if current is None or current.get("spec", {}).get("holderIdentity") != self.identity:
                holder = "nobody" if current is None else current.get("spec", {}).get("holderIdentity") or "nobody"
                self.lost = f"the deploy lock (Lease {self.name}) is held by {holder} now"
                return
            self.held = current
            self.renew()

    def _renew_until_released(self) -> None:
        while not self._stop.wait(self.duration_s / 3):
            try:
                self.renew()
            except Exception as exc:  # the API unreachable or garbled a while: try again;
                # check() stops the deploy once the last good write is a duration old
                log.warning("renewing the deploy lock failed (%s): trying again", first_line(exc))
            if self.lost:
                log.error("%s: this deploy stops before touching serving again", self.lost)
                return

    def check(self) -> None:
        """Before each change to serving: the Lease is still ours (renewed in time, not taken)."""
        if not self.lost and time.monotonic() > self.valid_until:
            self.lost = (f"the deploy lock (Lease {self.name}) was not renewed for {self.duration_s}s "
                         "(this process paused, or the API server unreachable): another deployer may hold it")
        if self.lost:
            raise LeaseLost(f"{self.lost}: this deploy stopped before changing serving")

    def release(self) -> None:
        """Hand the Lease back (holder cleared). Never raises: a failed release must not hide
        the step's own outcome; an unreleased Lease is free ``leaseDurationSeconds`` later. A
        SIGTERM arriving meanwhile does not stop it: the step is ending anyway."""
        self._stop.set()
        try:
            if self._renewer is not None:
                self._renewer.join(timeout=self._call_timeout_s * 2)
            if self.held is None or self.lost:
                return
            current = self._read()
            if current is not None and current.get("spec", {}).get("holderIdentity") == self.identity:
                spec = {k: v for k, v in current["spec"].items() if k not in ("holderIdentity", "renewTime")}
                self._call("PUT", f"{self.collection}/{self.name}", {**current, "spec": spec})
            log.info("deploy lock released (Lease %s)", self.name)
        except (Exception, Terminated) as exc:  # see the docstring
            log.warning("releasing the deploy lock (Lease %s) failed (%s): it is free in %ds anyway",
                        self.name, first_line(exc) or type(exc).__name__, self.duration_s)
        finally:
            self.held = None
