"""The traffic splitter in front of Triton: which version answers ``/v2/models/<m>/infer``, its
``generate`` / ``generate_stream`` and the OpenAI-compatible ``/v1/*``.

Locally a real nginx (Debian package) does it: ``split_clients`` on the request id sends
``canary_weight`` percent of requests to the canary version and the rest to the stable one, by
rewriting the path to ``/v2/models/<m>/versions/<v>/<action>``; ``/v1/*`` goes to the OpenAI
front (``tasks/serving/front.py``) with the chosen version in ``X-Route-Version`` (a client's own
header is overwritten). Every response says which version answered (``X-Model-Version``).
Clients get nothing else but health and metadata (no repository control, no version by its
path: :func:`nginx_conf`);
streams are passed through unbuffered, each token as it comes. A change writes ``split.conf``, checks it with
``nginx -t`` and reloads (SIGHUP: new workers take new connections, old ones finish theirs, so
no request is dropped: 0 of 500 lost here, where Caddy's config reload lost 2 of 2,664), then
waits until the live router reports the new generation and the workers of the old one have
exited (until then an old worker can still take a request by the old split). Callers that unload
a version after moving its traffic away rely on that wait.

In a cluster the same decision is a Gateway API HTTPRoute with weighted ``backendRefs`` (one
Service per track): ``plugins/serving.py`` renders it.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import shutil
import subprocess
import urllib.request
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

from tasks.config import DEMO_LABEL
from tasks.lib.errors import StepError
from tasks.lib.polling import wait_until
from tasks.serving.contract import (
    CLIENT_HEADER,
    COPY_HEADER,
    INTERNAL_HEADERS,
    MAX_BODY_BYTES,
    PAIR_HEADER,
    PUBLIC_LOGITS_ACTIONS,
    RECORD_HEADER,
    ROUTE_ENTRIES,
    ROUTE_HEADER,
    ROUTE_LINE,
    ROUTE_STABLE,
    ROUTED_ACTIONS,
    ROUTED_MODELS,
    VERSION_HEADER,
)

TEMP_KINDS = ("client_body", "proxy", "fastcgi", "uwsgi", "scgi")  # nginx's temp folders, kept in the prefix
SHADOW_LOCATION = "/_shadow"
# how long a reload waits for the old workers, and how long nginx lets them finish what they
# answer: a stream in flight finishes on its old worker, and one may last the engine's
# serve.generate.request_timeout_s (60 s; a test checks it stays below)
OLD_WORKERS_TIMEOUT_S = 90


@dataclass(frozen=True)
class Route:
    stable: int | None  # the version most traffic goes to (None: nothing deployed yet)
    canary: int | None = None
    canary_weight: float = 0.0  # percent of requests to the canary
    generation: int = 0  # bumped by every change, reported live by the router
    shadow: int | None = None  # gets a copy of every /v1 request; its answers go to no client

    def __post_init__(self) -> None:
        if not 0.0 <= self.canary_weight <= 100.0:
            raise ValueError(f"canary weight {self.canary_weight}: expected 0..100 percent")
        if self.canary_weight and self.canary is None:
            raise ValueError("a canary weight without a canary version")

    def versions(self) -> list[int]:
        return sorted({v for v in (self.stable, self.canary, self.shadow) if v is not None})


@dataclass(frozen=True)
class RoutedLine:
    """A model line as the router splits it: the key of its route (``demo``: params.yaml's line)
    and its two Triton models (logits, engine). Each line's split is a file of its own, written
    by that line's deploy alone: a rollout of one line never moves another's traffic."""

    key: str
    models: tuple[str, ...] = ROUTED_MODELS

    @property
    def var(self) -> str:
        """The suffix of its nginx variables (which take no '-'), one to one with the key."""
        return self.key.replace("_", "_u").replace("-", "_d")

    @property
    def split_file(self) -> str:
        return "split.conf" if self.key == DEMO_LABEL else f"split.{self.key}.conf"


DEMO_ROUTE = RoutedLine(DEMO_LABEL)


def routed_lines() -> list[RoutedLine]:
    """Every model line's (params.yaml's first), from their settings: what one router serves."""
    from tasks.config import every_line, line_label

    return [RoutedLine(line_label(line), (settings.serve.triton_model, settings.serve.generate_model))
            for line, settings in every_line().items()]


@dataclass(frozen=True)
class ClientLimits:
    """What one client address may ask of the public listener (params.yaml ``serve.router``)."""

    rate_per_client: int  # requests a second (nginx takes whole numbers)
    burst: int  # requests over the rate answered at once before the 429s start
    connections_per_client: int
    client_timeout_s: int  # to send a request's head, and its body (between two reads); nginx: whole seconds

    @classmethod
    def from_params(cls) -> ClientLimits:
        from tasks.lib.params import load_settings

        router = load_settings().serve.router  # bounds checked there (serve.router)
        return cls(router.rate_per_client, router.burst, router.connections_per_client, router.client_timeout_s)


@dataclass(frozen=True)
class Listeners:
    """Where the router listens, on ``host``: the public port (what clients call) and the internal
    one (deploy's). Loopback on the local stack; docker-compose.yaml's router listens on its network."""

    public_port: int
    internal_port: int
    host: str = "127.0.0.1"


@dataclass(frozen=True)
class Upstreams:
    """What the router passes requests to: Triton, and the OpenAI front (``/v1/*``). Loopback on the
    local stack; docker-compose.yaml's router reaches them by service name."""

    triton_port: int
    openai_port: int
    triton_host: str = "127.0.0.1"
    openai_host: str = "127.0.0.1"


def nginx_binary() -> str:
    found = shutil.which("nginx") or ("/usr/sbin/nginx" if Path("/usr/sbin/nginx").exists() else None)
    if found is None:
        raise StepError("nginx not found: `make` installs it (apt-get install nginx-light)")
    return found


def nginx_conf(prefix: Path, listen: Listeners, upstreams: Upstreams, limits: ClientLimits | None = None,
               lines: Sequence[RoutedLine] = (DEMO_ROUTE,)) -> str:
    """The router's static configuration for the model ``lines``; each line's split lives in its
    own file (:attr:`RoutedLine.split_file`).

    Triton's paths name a model, and so their line: ``$routed_version`` is that line's pick. The
    OpenAI API's ``/v1`` names its model in the body, which nginx does not read: the front gets
    every line's pick (:data:`~tasks.serving.contract.ROUTE_HEADER`) and answers with its line's.

    Two listeners. The public one (``listen.public_port``, what clients call) serves an allowlist: the
    split's inference paths, ``/v1/*``, health, server and model metadata, a model's readiness
    (the version the split picks for the request), the route state; anything else (Triton's repository control: load, unload, index; a path
    naming a version) is a 404 with a one-line reason, so no client can unload the champion or
    pick a version. The internal one (``listen.internal_port``, deploy's) adds each version's own
    inference paths: the smoke test and stable's baseline through the same nginx hop as the
    split's requests. Triton's control plane is on neither: deploy calls Triton itself.

    The public listener bounds each client address (:class:`ClientLimits`): over its request rate
    (past a burst) or its open connections a client gets a 429 with one line at once, and its
    request head and body must arrive in time; the internal listener (deploy's smoke test,
    baseline and canary traffic) has no such limits."""
    limits = limits or ClientLimits.from_params()
    models, actions = "|".join(m for line in lines for m in line.models), "|".join(ROUTED_ACTIONS)
    logits_models = "|".join(line.models[0] for line in lines)
    picked = ROUTE_ENTRIES.join(f"{line.key}{ROUTE_LINE}$version_{line.var}{ROUTE_STABLE}$stable_{line.var}"
                                for line in lines)
    shadows = ROUTE_ENTRIES.join(f"{line.key}{ROUTE_LINE}$shadow_{line.var}" for line in lines)
    states = ", ".join(f'"{line.key}": $state_{line.var}' for line in lines)
    model_versions = "\n".join(f"        {model} $version_{line.var};" for line in lines for model in line.models)
    splits = "\n".join(f"    include {prefix / line.split_file};" for line in lines)
    temp = "\n".join(f"    {kind}_temp_path {prefix / 'tmp' / kind};" for kind in TEMP_KINDS)
    to_triton = f"""proxy_http_version 1.1;
            proxy_set_header Connection "";
            proxy_buffering off;
            proxy_read_timeout 300s;
            {internal_headers({})}"""
    def routed(internal: bool) -> str:
        # only deploy's listener passes the record mark and pair id on (the front records a
        # request that has both: deploy's, at every stage, read back for the engines' own
        # timings): public requests are mirrored while a version shadows, never recorded
        record, pair = ('"1"', "$shadow_pair_id") if internal else ('""', '""')
        to_front = {ROUTE_HEADER: f'"{picked}"', RECORD_HEADER: record, PAIR_HEADER: pair,
                    CLIENT_HEADER: "$remote_addr"}
        to_shadow = {ROUTE_HEADER: f'"{shadows}"', RECORD_HEADER: record, PAIR_HEADER: pair, COPY_HEADER: "1",
                     CLIENT_HEADER: "$remote_addr"}
        # deploy reaches every model's inference paths; clients the logits models' (PUBLIC_LOGITS_ACTIONS)
        split_models, split_actions = (models, actions) if internal else (logits_models, "|".join(PUBLIC_LOGITS_ACTIONS))
        return f"""location = /router/state {{ default_type application/json; return 200 '{{{states}}}'; }}
        location ~ ^/v2/models/(?<model>{split_models})/(?<action>{split_actions})$ {{
            if ($routed_version = "") {{ return 503; }}
            {to_triton}
            proxy_pass http://triton/v2/models/$model/versions/$routed_version/$action;
            add_header {VERSION_HEADER} $routed_version always;
        }}
        location /v1/ {{  # the front answers 503 for a line that serves no version, and names the version
            include {prefix / 'mirror.conf'};
            proxy_http_version 1.1;
            proxy_set_header Connection "";
            proxy_buffering off;
            proxy_read_timeout 300s;
            {internal_headers(to_front)}
            proxy_pass http://openai;
        }}
        location = {SHADOW_LOCATION} {{  # the copy of a /v1 request for the shadow version (nginx mirror)
            internal;
            proxy_http_version 1.1;
            proxy_set_header Connection "";
            {internal_headers(to_shadow)}
            proxy_pass http://openai$request_uri;
        }}
        location ~ ^/v2/models/(?<model>{models})/ready$ {{  # tritonclient's is_model_ready: the routed version's
            limit_except GET HEAD {{ deny all; }}
            if ($routed_version = "") {{ return 503; }}
            {to_triton}
            proxy_pass http://triton/v2/models/$model/versions/$routed_version/ready;
            add_header {VERSION_HEADER} $routed_version always;
        }}
        location ~ ^/v2(/health/(live|ready)|/models/({models}))?$ {{
            limit_except GET HEAD {{ deny all; }}
            {to_triton}
            proxy_pass http://triton;
        }}
        location / {{
            default_type application/json;
            return 404 '{{"error": "not served by this router: its inference paths, /v1, health and metadata are"}}';
        }}"""
    return f"""# generated by tasks/serving/router.py: each model line's split lives in its split file
daemon off;
worker_processes 1;
worker_shutdown_timeout {OLD_WORKERS_TIMEOUT_S}s;
pid {prefix / 'nginx.pid'};
error_log {prefix / 'error.log'} warn;
events {{ worker_connections 1024; }}
http {{
    access_log {prefix / 'access.log'};
{temp}
    # what the front and Triton take: larger bodies are refused here (413), never read further
    client_max_body_size {MAX_BODY_BYTES};
    # bodies and buffered answers stay in memory, never in temp files: a root master runs its
    # workers as nobody, who may not reach the prefix folder (a request over 16 KB had failed with
    # 500); twice the largest body, as a chunked one of the limit spilled to a file (500) at once
    client_body_buffer_size {2 * MAX_BODY_BYTES};
    proxy_max_temp_file_size 0;
    # a shadow's pair id: deploy's generator sends one per request (32 hex digits), read back by it
    map $http_x_shadow_pair $shadow_pair_id {{ "~^[0-9a-f]{{32}}$" $http_x_shadow_pair; default ""; }}
{splits}
    # a Triton path's model names its line: that line's pick
    map $model $routed_version {{
        default "";
{model_versions}
    }}
    upstream triton {{ server {upstreams.triton_host}:{upstreams.triton_port}; keepalive 32; }}
    upstream openai {{ server {upstreams.openai_host}:{upstreams.openai_port}; keepalive 32; }}
    # per client address: a flood or a pile of slow connections from one client is refused at
    # once, before it queues in front of Triton; what other clients send is not touched
    limit_req_zone $binary_remote_addr zone=per_client_rate:10m rate={limits.rate_per_client}r/s;
    limit_conn_zone $binary_remote_addr zone=per_client_connections:10m;
    limit_req_status 429;
    limit_conn_status 429;
    server {{  # public: what clients call
        listen {listen.host}:{listen.public_port};
        client_header_timeout {limits.client_timeout_s}s;
        client_body_timeout {limits.client_timeout_s}s;
        limit_req zone=per_client_rate burst={limits.burst} nodelay;
        limit_conn per_client_connections {limits.connections_per_client};
        error_page 429 @limited;
        location @limited {{
            default_type application/json;
            return 429 '{{"error": "too many requests from this client: at most {limits.rate_per_client} a second (a burst of {limits.burst}) and {limits.connections_per_client} connections"}}';
        }}
        error_page 503 @no_version;
        location @no_version {{  # the split names no version yet (nothing deployed)
            default_type application/json;
            return 503 '{{"error": {{"message": "no model version is deployed yet", "type": "server_error", "param": null, "code": "no_version"}}}}';
        }}
        error_page 413 @too_large;
        location @too_large {{
            default_type application/json;
            return 413 '{{"error": {{"message": "request body larger than {MAX_BODY_BYTES} bytes", "type": "invalid_request_error", "param": null, "code": "request_too_large"}}}}';
        }}
        {routed(internal=False)}
    }}
    server {{  # internal: deploy's smoke test and stable's baseline, a version by its path
        listen {listen.host}:{listen.internal_port};
        location ~ ^/v2/models/(?<model>{models})/versions/(?<version>[0-9]+)/(?<action>{actions})$ {{
            {to_triton}
            proxy_pass http://triton/v2/models/$model/versions/$version/$action;
            add_header X-Model-Version $version always;
        }}
        {routed(internal=True)}
    }}
}}
"""


def internal_headers(values: dict[str, str]) -> str:
    """``proxy_set_header`` for every header only the router sets: ``values``' own, the others
    empty (nginx then sends none, a client's own value included)."""
    return "\n            ".join(f'proxy_set_header {name} {values.get(name, chr(34) * 2)};' for name in INTERNAL_HEADERS)


def mirror_conf(routes: Mapping[str, Route]) -> str:
    """The ``/v1/`` locations' mirror directives: a copy of each request (body included) while any
    line's version shadows (the front drops the copy of a request whose line has no shadow), or
    nothing."""
    if all(route.shadow is None for route in routes.values()):
        return "# no shadow version: nothing mirrored\n"
    return f"mirror {SHADOW_LOCATION};\nmirror_request_body on;\n"


def split_conf(route: Route, line: RoutedLine = DEMO_ROUTE) -> str:
    """One line's split: its pick per request, its stable, its shadow and its state."""
    def version(value: int | None) -> str:
        return f'"{value if value is not None else ""}"'

    var, state = line.var, json.dumps(asdict(route))
    lines = [f'split_clients "${{request_id}}" $version_{var} {{']
    if route.canary is not None and route.canary_weight >= 100:
        lines.append(f"    * {version(route.canary)};")
    else:
        if route.canary is not None and route.canary_weight > 0:
            lines.append(f"    {route.canary_weight:g}% {version(route.canary)};")
        lines.append(f"    * {version(route.stable)};")
    lines.append("}")
    lines.append(f'map "" $stable_{var} {{ default {version(route.stable)}; }}')
    lines.append(f'map "" $shadow_{var} {{ default {version(route.shadow)}; }}')
    lines.append(f"map \"\" $state_{var} {{ default '{state}'; }}")
    if line.key == DEMO_LABEL:
        # what an nginx.conf rendered by older code reads (a router started before one API served
        # every line, until its restart): without them nginx -t refuses every route change
        lines.append(f'map "" $model_version {{ default $version_{var}; }}')
        lines.append(f'map "" $shadow_version {{ default $shadow_{var}; }}')
        lines.append('map "" $shadow_record { default "1"; }')
        lines.append(f"map \"\" $route_state {{ default '{state}'; }}")
    return "\n".join(lines) + "\n"


def saved_route(prefix: Path, line: RoutedLine = DEMO_ROUTE) -> Route:
    """The route ``line``'s split file holds: what the router applies once started (none yet: no model)."""
    path = prefix / line.split_file
    if not path.exists():
        return Route(stable=None)
    text = path.read_text()
    marker = next(m for m in (f"$state_{line.var} {{ default '", "$route_state { default '", "") if m in text)
    if not marker:
        raise ValueError(f"{path}: holds no route state")
    return Route(**json.loads(text.split(marker, 1)[1].split("';", 1)[0]))


def write_router_config(prefix: Path, listen: Listeners, upstreams: Upstreams,
                        lines: Sequence[RoutedLine] | None = None) -> Path:
    """nginx.conf for every model line (``lines``: all the settings name), and each line's saved
    split and the mirror (an empty split where none exists yet)."""
    lines = routed_lines() if lines is None else lines
    for kind in TEMP_KINDS:
        (prefix / "tmp" / kind).mkdir(parents=True, exist_ok=True)
    conf = prefix / "nginx.conf"
    conf.write_text(nginx_conf(prefix, listen, upstreams, lines=lines))
    # the saved routes (none yet: no model) written again in this code's form: a split file of
    # older code lacks variables nginx.conf now uses
    routes = {line.key: saved_route(prefix, line) for line in lines}
    for line in lines:
        (prefix / line.split_file).write_text(split_conf(routes[line.key], line))
    (prefix / "mirror.conf").write_text(mirror_conf(routes))
    return conf


def served_routes(prefix: Path) -> dict[str, Route]:
    """Every line's saved route, by key, as the router's nginx.conf includes them."""
    included = [Path(line.split()[1].rstrip(";")).name for line in (prefix / "nginx.conf").read_text().splitlines()
                if line.strip().startswith("include ")]
    files = [name for name in included if name.startswith("split.") and name.endswith(".conf")]
    keys = [DEMO_LABEL if name == "split.conf" else name.removeprefix("split.").removesuffix(".conf") for name in files]
    return {key: saved_route(prefix, RoutedLine(key)) for key in keys}


class NginxRouter:
    """The local router, as one model line's deploy drives it: its prefix folder (config, pid),
    its public URL and its internal one, and the line (``demo``: params.yaml's) whose split it moves."""

    def __init__(self, prefix: Path, url: str, internal_url: str, timeout_s: float = OLD_WORKERS_TIMEOUT_S + 5,
                 line: str = DEMO_LABEL) -> None:
        self.prefix, self.url, self.internal_url = prefix, url.rstrip("/"), internal_url.rstrip("/")
        self.timeout_s, self.line = timeout_s, RoutedLine(line)

    @classmethod
    def from_env(cls, line: str = DEMO_LABEL) -> NginxRouter:
        missing = [k for k in ("ROUTER_DIR", "ROUTER_URL", "ROUTER_INTERNAL_URL") if not os.environ.get(k)]
        if missing:
            raise StepError(f"{', '.join(missing)} not set: the local router is started by `python -m stack up`")
        return cls(Path(os.environ["ROUTER_DIR"]), os.environ["ROUTER_URL"], os.environ["ROUTER_INTERNAL_URL"],
                   line=line)

    def states(self) -> dict[str, Route]:
        """What the running router applies now, every line's."""
        try:
            with urllib.request.urlopen(f"{self.url}/router/state", timeout=5) as resp:
                states = json.loads(resp.read())
        except OSError as exc:
            raise RuntimeError(f"router {self.url} not reachable ({exc}): is the stack up?") from None
        if "stable" in states:  # a router of older code, until its restart: the demo line's state alone
            return {DEMO_LABEL: Route(**states)}
        return {key: Route(**state) for key, state in states.items()}

    def live(self) -> Route:
        """What the running router applies now to this line."""
        states = self.states()
        if self.line.key not in states:
            raise StepError(f"the router serves no line {self.line.key!r} (it serves {', '.join(states)}): a line "
                            "added since the stack started is served once `python -m stack up` restarts the router")
        return states[self.line.key]

    @contextlib.contextmanager
    def changing(self) -> Iterator[None]:
        """One route change at a time, whatever the line: each reload takes every line's files."""
        with (self.prefix / "router.lock").open("w") as fh:
            fcntl.flock(fh, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(fh, fcntl.LOCK_UN)

    def apply(self, stable: int | None, canary: int | None = None, canary_weight: float = 0.0,
              shadow: int | None = None) -> Route:
        """Route this line's traffic so, and return once the live router does."""
        with self.changing():
            route = Route(stable, canary, float(canary_weight), self.live().generation + 1, shadow)
            routes = {**served_routes(self.prefix), self.line.key: route}
            files = {self.line.split_file: split_conf(route, self.line), "mirror.conf": mirror_conf(routes)}
            previous = {name: (self.prefix / name).read_text() for name in files if (self.prefix / name).exists()}
            for name, text in files.items():
                staged = self.prefix / f".{name}.{os.getpid()}"
                staged.write_text(text)
                staged.replace(self.prefix / name)
            command = [nginx_binary(), "-p", str(self.prefix), "-c", str(self.prefix / "nginx.conf")]
            checked = subprocess.run([*command, "-t", "-q"], capture_output=True, text=True)
            if checked.returncode != 0:
                for name, text in previous.items():
                    (self.prefix / name).write_text(text)  # never leave a config the next reload would refuse
                raise RuntimeError(f"router config rejected by nginx -t: {checked.stderr.strip()[-300:]}")
            old_workers = self.worker_pids()
            subprocess.run([*command, "-s", "reload"], check=True, capture_output=True)

        def applied() -> bool:  # the new generation served, and no worker of the old config left
            return self.live().generation == route.generation and not old_workers & self.worker_pids()

        wait_until(applied, self.timeout_s, 0.05, lambda: RuntimeError(
            f"router did not apply generation {route.generation} in {self.timeout_s:.0f}s "
            f"(old workers left: {sorted(old_workers & self.worker_pids())})"))
        return route

    def worker_pids(self) -> set[int]:
        """The live children of this router's nginx master; empty where the master is not a
        process of this machine's view (the compose stack's router runs in a container of its own)."""
        try:
            master = int((self.prefix / "nginx.pid").read_text())
            if not Path(f"/proc/{master}/cmdline").read_bytes().startswith(b"nginx: master"):
                return set()
        except (OSError, ValueError):
            return set()
        children = set()
        for stat in Path("/proc").glob("[0-9]*/stat"):
            try:
                state, parent = stat.read_text().rsplit(")", 1)[1].split()[:2]
            except (OSError, ValueError):
                continue  # exited while listed
            if int(parent) == master and state != "Z":
                children.add(int(stat.parent.name))
        return children
