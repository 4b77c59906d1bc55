"""The serving servers (Triton, the OpenAI front, the router: commands, environments, whether a
running router is current) and serving's reconciliation: what the router's saved route serves,
loaded into a Triton that started empty, and the route published again."""

from __future__ import annotations

import fcntl
import json
import os
import sys
import urllib.request
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from tasks.serving.router import RoutedLine

from stack.credentials import capture_env, client_env, secret
from stack.state import REPO_ROOT, ports, router_dir, state_dir, triton_repository
from stack.supervise import StackError
from tasks.config import ServeSettings, every_line


def _pytriton_dir() -> Path:
    import pytriton

    return Path(pytriton.__file__).parent / "tritonserver"


def _triton_backends() -> Path:
    """Triton's backend folder: the wheel's python backend plus the stub built for this
    interpreter's Python version (the wheel ships one per version beside the backend)."""
    wheel = _pytriton_dir()
    python = state_dir() / "triton" / "backends" / "python"
    python.mkdir(parents=True, exist_ok=True)
    version = f"{sys.version_info.major}.{sys.version_info.minor}"
    for source in (wheel / "backends" / "python" / "libtriton_python.so",
                   wheel / "backends" / "python" / "triton_python_backend_utils.py",
                   wheel / "python_backend_stubs" / version / "triton_python_backend_stub"):
        link = python / source.name
        if link.is_symlink() or link.exists():
            link.unlink()
        link.symlink_to(source)
    return python.parent


def triton_command() -> list[str]:
    port = ports()
    triton_repository().mkdir(parents=True, exist_ok=True)
    return [
        str(_pytriton_dir() / "bin" / "tritonserver"),
        f"--model-repository={triton_repository()}",
        f"--backend-directory={_triton_backends()}",
        "--model-control-mode=explicit",  # deploy loads and unloads versions
        "--strict-readiness=false",
        "--exit-on-error=false",
        "--http-address=127.0.0.1", f"--http-port={port['triton_http']}",
        "--grpc-address=127.0.0.1", f"--grpc-port={port['triton_grpc']}",
        "--metrics-address=127.0.0.1", f"--metrics-port={port['triton_metrics']}",
        "--allow-gpu-metrics=false",
        "--metrics-config=summary_latencies=true",  # latency quantiles per version (the p99 of the dashboard)
        "--log-verbose=0",
    ]


def triton_env() -> dict[str, str]:
    """The python stub links libpython: it must find this interpreter's (a distribution's
    older libpython of the same minor version breaks it), and import from this venv."""
    import sysconfig

    libs = [str(sysconfig.get_config_var("LIBDIR")), str(_pytriton_dir().parent.parent / "nvidia_pytriton.libs")]
    venv_bin = str(Path(sys.executable).parent)
    return {
        "LD_LIBRARY_PATH": ":".join([*libs, os.environ.get("LD_LIBRARY_PATH", "")]).rstrip(":"),
        "PATH": f"{venv_bin}:{os.environ.get('PATH', '')}",
        "PYTHONPATH": str(Path(sysconfig.get_paths()["purelib"])),
    }


def openai_api_env() -> dict[str, str]:
    """The front writes its served-traffic capture (serve.capture) with the capture's keys alone:
    it is the process clients reach, and the pipeline's keys could replace what Triton runs."""
    # CAPTURE_CLIENT_KEY keys the hash of each client's address the capture keeps (the drift
    # check counts clients by it): one per stack folder, so a restarted front hashes alike
    return {"PYTHONPATH": str(REPO_ROOT), **capture_env(), "CAPTURE_CLIENT_KEY": secret("capture_client_key")}


def openai_api_command() -> list[str]:
    """The OpenAI-compatible front (tasks/serving/front.py): the router sends /v1/* to it."""
    return [sys.executable, "-m", "tasks.serving.front", "--port", str(ports()["openai_api"]),
            "--triton-url", client_env()["TRITON_URL"]]


def router_command() -> list[str]:
    from tasks.serving.router import Listeners, Upstreams, nginx_binary, write_router_config

    port = ports()
    conf = write_router_config(router_dir(), Listeners(port["router"], port["router_internal"]),
                               Upstreams(port["triton_http"], port["openai_api"]))
    return [nginx_binary(), "-p", str(router_dir()), "-c", str(conf)]


def served_lines() -> list[tuple[RoutedLine, ServeSettings]]:
    """Every model line one stack serves (params.yaml's first): its route and its serve settings."""
    from tasks.serving.router import routed_lines

    return list(zip(routed_lines(), (settings.serve for settings in every_line().values()), strict=True))


def refresh_router() -> bool:
    """The running router of this stack made current in place: its configuration written again
    (every line the settings name now) and reloaded (new nginx workers take new connections, the
    old ones finish theirs: no request refused), then waited for. False where the running process
    is not this folder's nginx master, or the reload did not take: it is restarted instead."""
    import subprocess

    from stack.state import state_dir
    from tasks.lib.polling import wait_until
    from tasks.serving.router import NginxRouter

    prefix = router_dir()
    try:
        master = int((state_dir() / "router.pid").read_text())
        if master != int((prefix / "nginx.pid").read_text()) or \
                not Path(f"/proc/{master}/cmdline").read_bytes().startswith(b"nginx: master"):
            return False
    except (OSError, ValueError):
        return False
    urls = [client_env()[url] for url in ("ROUTER_URL", "ROUTER_INTERNAL_URL")]
    with NginxRouter(prefix, urls[0], urls[1]).changing():  # no deploy's route change in between
        command = router_command()  # writes the configuration
        if subprocess.run([*command, "-t", "-q"], capture_output=True).returncode != 0:
            return False
        if subprocess.run([*command, "-s", "reload"], capture_output=True).returncode != 0:
            return False
    try:
        wait_until(lambda: all(router_current(url) for url in urls), 15, 0.1, lambda: TimeoutError())
    except TimeoutError:
        return False
    return True


def router_current(url: str) -> bool:
    """The router answers every model line's route state, in this code's form: one started by
    older code (one line's state alone, or whose nginx.conf lacks the shadow's mirror), or before
    a line was added, is not reused; it is restarted on this code's config, its saved routes kept."""
    try:
        with urllib.request.urlopen(f"{url}/router/state", timeout=2) as resp:
            states = json.loads(resp.read())
    except (OSError, ValueError):
        return False
    expected = {line.key for line, _ in served_lines()}
    return (isinstance(states, dict) and set(states) == expected
            and all(isinstance(state, dict) and "shadow" in state for state in states.values()))


def front_current(url: str) -> bool:
    """The OpenAI front is up, of this code, and serves every model line (it finds a line added
    since it started itself: Api.rediscover; one whose lines differ still is restarted)."""
    try:
        with urllib.request.urlopen(f"{url}/v1/models", timeout=2) as resp:
            cards = json.loads(resp.read())["data"]
        served = {card["id"] for card in cards}
    except (OSError, ValueError, KeyError, TypeError):
        return False
    # each card names its line's version: a front of older code (one line, no version) reads the
    # router's per-line header as no version at all, and is restarted
    return all("version" in card for card in cards) and served == {
        settings.pipeline.model_name for settings in every_line().values()}


ROUTE_READ_ERRORS = (OSError, ValueError, IndexError, KeyError)  # Triton not answering, a split file unreadable


def route_versions_ready(client: Any, routes: Path | None = None) -> tuple[dict[str, list[int]], bool]:
    """The versions each line's saved route (in ``routes``, the local router's folder by default)
    sends traffic to (stable, any canary), by line, and whether Triton (``client``) has each of
    them READY in both of its line's models."""
    from tasks.serving.router import saved_route

    versions = {line.key: saved_route(routes or router_dir(), line).versions() for line, _ in served_lines()}
    ready = all(client.model_ready(model, version) for line, _ in served_lines()
                for model in line.models for version in versions[line.key])
    return versions, ready


def serving_client(triton_url: str | None = None) -> Any:
    """A client of the stack's Triton (or the one at ``triton_url``)."""
    from tasks.lib import triton

    return triton.TritonClient(triton_url or client_env()["TRITON_URL"])


def reconcile_serving(env: Mapping[str, str] | None = None) -> dict[str, list[int]]:
    """Triton (explicit model control) starts with no model loaded: load what each line's saved
    route serves (stable and any canary) from the model repository, before the router starts
    taking traffic, so a restarted Triton serves every line's champion with no deploy. ``env``:
    where Triton (``TRITON_URL``), its repository (``TRITON_REPOSITORY``) and the router's folder
    (``ROUTER_DIR``) are: the local stack's by default, the container's in docker-compose.yaml
    (its ``serving-reconcile`` service). Returns the versions it had to load, by line."""
    from tasks.lib.errors import StepError
    from tasks.serving.platforms import deploy_lock_file, serve_versions
    from tasks.serving.router import saved_route

    env = env or client_env()
    routes = Path(env["ROUTER_DIR"])
    routes.mkdir(parents=True, exist_ok=True)
    client, loaded = serving_client(env["TRITON_URL"]), {}
    for line, serve in served_lines():
        with (routes / deploy_lock_file(line.key)).open("w") as lock:
            try:  # a deploy of the line running now owns what Triton serves of it (it may be loading a canary)
                fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                continue
            try:
                versions = saved_route(routes, line).versions()
                if all(client.model_ready(model, v) for model in line.models for v in versions):
                    continue
                serve_versions(client, Path(env["TRITON_REPOSITORY"]), serve, versions)
                loaded[line.key] = versions
            except (StepError, *ROUTE_READ_ERRORS) as exc:
                raise StackError(f"serving: line {line.key}'s route's versions could not be loaded ({exc})") from None
    return loaded


def publish_saved_route(env: Mapping[str, str]) -> None:
    """Every line's saved route, pushed again (a Pushgateway restarted without its persistence
    file, or with one older than the route, holds another route:
    without it the alert on versions Triton does not serve would see no route until a deploy)."""
    from tasks.serving.platforms import publish_route
    from tasks.serving.router import saved_route

    if env.get("PUSHGATEWAY_URL"):
        for line, serve in served_lines():
            publish_route(saved_route(Path(env["ROUTER_DIR"]), line), serve, env, line=line.key)
