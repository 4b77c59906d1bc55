"""A Kubernetes API server for the deploy step's cluster code, in process (no cluster can run on
these machines): the verbs and semantics ``tasks/lib/kube.py`` and ``KubernetesServing`` rely on.

- GET, POST (create: 409 if the name exists), PUT (409 unless the body's ``resourceVersion`` is
  the stored one: optimistic concurrency), PATCH as JSON patch (RFC 6902 ``test``/``replace``/
  ``add``: a failed test is a 422 and changes nothing) and JSON merge patch (RFC 7386). Each write
  bumps ``resourceVersion``, and ``generation`` when ``spec`` changed; writes are atomic.
- Controllers, at once: a Deployment's status says it rolled out, unless ``stuck`` says its pod
  template never gets ready (then its new pods stay unavailable); an HTTPRoute is accepted by its
  gateway at its current generation.
"""

from __future__ import annotations

import copy
import http.server
import json
import threading
from collections.abc import Callable
from typing import Any


def apply_json_patch(obj: dict[str, Any], ops: list[dict[str, Any]]) -> dict[str, Any]:
    """RFC 6902 ``test``/``replace``/``add`` on a copy, as the API server applies them."""
    out = json.loads(json.dumps(obj))
    for op in ops:
        *parents, leaf = [p.replace("~1", "/").replace("~0", "~") for p in op["path"].split("/")[1:]]
        node: Any = out
        for part in parents:
            node = node[int(part)] if isinstance(node, list) else node[part]
        key: Any = int(leaf) if isinstance(node, list) else leaf
        if op["op"] == "test":
            assert node[key] == op["value"], f"test failed at {op['path']}: {node[key]!r}"
        elif op["op"] == "replace":
            assert (key < len(node)) if isinstance(node, list) else (key in node), f"nothing to replace at {op['path']}"
            node[key] = op["value"]
        else:
            node[key] = op["value"]
    return out


def merge_patch(obj: Any, patch: Any) -> Any:
    """RFC 7386 JSON merge patch."""
    if not isinstance(patch, dict):
        return patch
    out = dict(obj) if isinstance(obj, dict) else {}
    for key, value in patch.items():
        if value is None:
            out.pop(key, None)
        else:
            out[key] = merge_patch(out.get(key), value)
    return out


def kubectl_apply(live: Any, last_applied: Any, manifest: Any) -> Any:
    """``kubectl apply`` (client-side) of one object: a three-way merge of the manifest applied
    last time (its last-applied annotation; None after a plain ``kubectl create``), the new
    manifest and the live object. What the new manifest sets is set, what only the last one set
    is removed, what neither set (the deploy step's fields) is kept. Lists are replaced whole, as
    JSON merge patch does for custom resources (the fields deploy owns all sit in maps)."""
    if not (isinstance(manifest, dict) and isinstance(live, dict)):
        return copy.deepcopy(manifest)
    before = last_applied if isinstance(last_applied, dict) else {}
    out = {k: v for k, v in live.items() if k in manifest or k not in before}
    for key, value in manifest.items():
        out[key] = kubectl_apply(live.get(key), before.get(key), value)
    return out


VERBS = {"GET": "get", "POST": "create", "PUT": "update", "PATCH": "patch", "DELETE": "delete"}


def role_allows(role: dict[str, Any], method: str, path: str) -> bool:
    """Whether an RBAC Role grants a request (``/apis/<group>/<version>/namespaces/<ns>/<resource>[/<name>]``)."""
    parts = path.split("?")[0].strip("/").split("/")
    group, at = ("", 2) if parts[0] == "api" else (parts[1], 3)  # at: where "namespaces" is
    resource, name = parts[at + 2], (parts[at + 3] if len(parts) > at + 3 else None)
    return any(group in rule["apiGroups"] and resource in rule["resources"] and VERBS[method] in rule["verbs"]
               and (not rule.get("resourceNames") or name in rule["resourceNames"]) for rule in role["rules"])


def object_path(obj: dict[str, Any], namespace: str) -> str:
    group_version, kind = obj["apiVersion"], obj["kind"].lower() + "s"
    prefix = "/api/v1" if group_version == "v1" else f"/apis/{group_version}"
    return f"{prefix}/namespaces/{namespace}/{kind}/{obj['metadata']['name']}"


class FakeKubeApi:
    """The server; ``url`` for :class:`tasks.lib.kube.KubeApi`, ``objects`` by API path."""

    def __init__(self, namespace: str, objects: list[dict[str, Any]] = (),  # type: ignore[assignment]
                 stuck: Callable[[dict[str, Any]], bool] = lambda deployment: False) -> None:
        self.namespace, self.stuck = namespace, stuck
        self.objects: dict[str, dict[str, Any]] = {}
        self.lock = threading.Lock()
        self.requests: list[tuple[str, str, int]] = []  # method, path, status
        for obj in objects:
            self.store(object_path(obj, namespace), copy.deepcopy(obj), None)
        api = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def log_message(self, *args: object) -> None:
                pass

            def answer(self, status: int, body: Any) -> None:
                data = json.dumps(body).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)
                api.requests.append((self.command, self.path, status))

            def body(self) -> Any:
                return json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))) or b"null")

            def do_GET(self) -> None:
                with api.lock:
                    found = api.objects.get(self.path)
                self.answer(200, found) if found else self.answer(404, {"message": "not found"})

            def do_POST(self) -> None:
                body = self.body()
                path = f"{self.path}/{body['metadata']['name']}"
                with api.lock:
                    if path in api.objects:
                        return self.answer(409, {"message": "already exists"})
                    self.answer(201, api.store(path, body, None))

            def do_PUT(self) -> None:
                body = self.body()
                with api.lock:
                    current = api.objects.get(self.path)
                    if current is None:
                        return self.answer(404, {"message": "not found"})
                    if body["metadata"].get("resourceVersion") != current["metadata"]["resourceVersion"]:
                        return self.answer(409, {"message": "the object has been modified"})
                    self.answer(200, api.store(self.path, body, current))

            def do_PATCH(self) -> None:
                patch = self.body()
                with api.lock:
                    current = api.objects.get(self.path)
                    if current is None:
                        return self.answer(404, {"message": "not found"})
                    try:
                        if self.headers["Content-Type"] == "application/json-patch+json":
                            patched = apply_json_patch(current, patch)
                        else:
                            patched = merge_patch(copy.deepcopy(current), patch)
                    except (AssertionError, KeyError, IndexError) as exc:
                        return self.answer(422, {"message": str(exc)})
                    self.answer(200, api.store(self.path, patched, current))

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def store(self, path: str, obj: dict[str, Any], current: dict[str, Any] | None) -> dict[str, Any]:
        """Write ``obj`` (the caller holds the lock), with the controllers' status."""
        meta = obj.setdefault("metadata", {})
        meta["namespace"] = self.namespace
        meta["resourceVersion"] = str(int(current["metadata"]["resourceVersion"]) + 1 if current else 1)
        generation = current["metadata"].get("generation", 1) if current else 1
        meta["generation"] = generation + 1 if current and obj.get("spec") != current.get("spec") else generation
        if obj["kind"] == "Deployment":
            wanted = obj["spec"].get("replicas", 1)
            ready = 0 if self.stuck(obj) else wanted
            obj["status"] = {"observedGeneration": meta["generation"], "replicas": wanted, "updatedReplicas": ready,
                             "availableReplicas": ready}
        elif obj["kind"] == "HTTPRoute":
            accepted = {"type": "Accepted", "status": "True", "observedGeneration": meta["generation"]}
            obj["status"] = {"parents": [{"conditions": [accepted]}]}
        self.objects[path] = obj
        return copy.deepcopy(obj)

    def get(self, obj_or_path: str) -> dict[str, Any]:
        with self.lock:
            return copy.deepcopy(self.objects[obj_or_path])

    def __enter__(self) -> FakeKubeApi:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.shutdown()
        self.server.server_close()
