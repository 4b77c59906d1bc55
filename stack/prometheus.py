"""Prometheus and the Pushgateway: their logins (web configs, bcrypt hashes, scrape passwords),
their commands, Prometheus' scrape config, and a health check that asks for the login."""

from __future__ import annotations

import functools
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import yaml

from stack.credentials import PROMETHEUS_USER, PUSHGATEWAY_USER, client_env, secret
from stack.state import REPO_ROOT, ports, state_dir, write_private
from stack.supervise import debian_bin, http_ok
from tasks.lib.metrics import basic_auth

# The files of write_metrics_auth: each server's web config (its users' bcrypt hashes), the
# passwords Prometheus scrapes with (itself, and the Pushgateway) and the Pushgateway's own
# (its health check in compose)
PROMETHEUS_WEB, PUSHGATEWAY_WEB = "prometheus-web.yml", "pushgateway-web.yml"
PROMETHEUS_PASSWORD_FILE, PUSHGATEWAY_PASSWORD_FILE = "prometheus.password", "pushgateway.password"


def web_config(username: str, password: str) -> str:
    """A Prometheus server's ``--web.config.file`` (Prometheus and the Pushgateway read the same
    format): one basic-auth user, its password as a bcrypt hash. Every path asks for it, health
    included."""
    import bcrypt

    hashed = bcrypt.hashpw(password.encode(), bcrypt.gensalt(rounds=10)).decode()
    return yaml.safe_dump({"basic_auth_users": {username: hashed}})


def write_metrics_auth(prometheus_dir: Path, pushgateway_dir: Path, prometheus_password: str,
                       pushgateway_password: str, mode: int = 0o600) -> None:
    """The logins of Prometheus (people, Grafana, its own scrape) and the Pushgateway (the steps
    push, Prometheus scrapes), as each server reads them from its folder: Prometheus' holds its
    web config and both passwords it scrapes with, the Pushgateway's only its own web config and
    password (one folder locally). ``mode`` 0644 in docker-compose.yaml, where the servers run as
    another user than the one-shot that writes them (each folder is a volume only its server
    mounts)."""
    hashed_prometheus = web_config(PROMETHEUS_USER, prometheus_password)
    hashed_pushgateway = web_config(PUSHGATEWAY_USER, pushgateway_password)
    for folder, files in ((prometheus_dir, {PROMETHEUS_WEB: hashed_prometheus, PROMETHEUS_PASSWORD_FILE: prometheus_password,
                                            PUSHGATEWAY_PASSWORD_FILE: pushgateway_password}),
                          (pushgateway_dir, {PUSHGATEWAY_WEB: hashed_pushgateway,
                                             PUSHGATEWAY_PASSWORD_FILE: pushgateway_password})):
        for name, text in files.items():
            write_private(folder / name, text, mode)


def _metrics_auth_dir() -> Path:
    """The local stack's logins, written again at each start from its secrets (both servers read
    their web config at each request: replacing it with the same passwords changes nothing)."""
    return _write_local_metrics_auth(state_dir() / "metrics-auth")


@functools.cache
def _write_local_metrics_auth(folder: Path) -> Path:
    """Once per process and folder: the Pushgateway's command and Prometheus' config and command
    all name it, and each write hashes both passwords with bcrypt."""
    write_metrics_auth(folder, folder, secret("prometheus_admin"), secret("pushgateway_pipeline"))
    return folder


def pushgateway_command() -> list[str]:
    """The Pushgateway, its pushes kept in this stack's folder across restarts. Debian's build
    defaults to one file for the whole machine (/var/lib/prometheus/pushgateway.data): every stack
    on it (a developer's, the tests', the benchmarks') read and overwrote the others' runs."""
    persisted = state_dir() / "pushgateway" / "metrics.data"
    persisted.parent.mkdir(parents=True, exist_ok=True)
    return [debian_bin("prometheus-pushgateway"), f"--web.listen-address=127.0.0.1:{ports()['pushgateway']}",
            f"--web.config.file={_metrics_auth_dir() / PUSHGATEWAY_WEB}", f"--persistence.file={persisted}"]


def prometheus_config(targets: dict[str, str], rule_file: str, auth_dir: str) -> dict[str, Any]:
    """Scrape Triton (per-version request counters and latencies) and the Pushgateway (each run's
    figures, labels kept as pushed) and, where one runs, the StatsD exporter holding Airflow's own
    metrics; evaluate the alert rules. ``targets``: host:port of ``prometheus``, ``pushgateway``,
    ``triton`` (its metrics port) and optionally ``statsd_exporter`` (docker-compose.yaml only).
    ``auth_dir``: where the passwords of write_metrics_auth are (Prometheus and the Pushgateway
    ask for logins, itself included)."""
    def login(username: str, password_file: str) -> dict[str, Any]:
        return {"basic_auth": {"username": username, "password_file": f"{auth_dir}/{password_file}"}}

    jobs = [
        {"job_name": "prometheus", **login(PROMETHEUS_USER, PROMETHEUS_PASSWORD_FILE),
         "static_configs": [{"targets": [targets["prometheus"]]}]},
        {"job_name": "pushgateway", "honor_labels": True, **login(PUSHGATEWAY_USER, PUSHGATEWAY_PASSWORD_FILE),
         "static_configs": [{"targets": [targets["pushgateway"]]}]},
        {"job_name": "triton", "static_configs": [{"targets": [targets["triton"]]}]},
    ]
    if "statsd_exporter" in targets:
        jobs.append({"job_name": "airflow", "static_configs": [{"targets": [targets["statsd_exporter"]]}]})
    return {"global": {"scrape_interval": "5s", "evaluation_interval": "5s"}, "rule_files": [rule_file],
            "scrape_configs": jobs}


def write_prometheus_config() -> Path:
    port = ports()
    config = prometheus_config(
        {"prometheus": f"127.0.0.1:{port['prometheus']}", "pushgateway": f"127.0.0.1:{port['pushgateway']}",
         "triton": f"127.0.0.1:{port['triton_metrics']}"},
        str(REPO_ROOT / "observability" / "alerts.yml"), str(_metrics_auth_dir()))
    path = state_dir() / "prometheus" / "prometheus.yml"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    return path


def prometheus_command() -> list[str]:
    return [debian_bin("prometheus"), f"--config.file={write_prometheus_config()}",
            f"--storage.tsdb.path={state_dir() / 'prometheus' / 'data'}",
            f"--web.listen-address=127.0.0.1:{ports()['prometheus']}",
            f"--web.config.file={_metrics_auth_dir() / PROMETHEUS_WEB}"]


def asks_for_login(server: str, path: str) -> bool:
    """``path`` of the Prometheus server named ``server`` (pushgateway, prometheus) answers 200
    to the stack's login and 401 without one (a server started by older code, which asks for
    none, is not reused: it is restarted with its login)."""
    env = client_env()
    url, prefix = f"{env[f'{server.upper()}_URL']}{path}", server.upper()
    if not http_ok(url, basic_auth(env[f"{prefix}_USERNAME"], env[f"{prefix}_PASSWORD"])):
        return False
    try:
        urllib.request.urlopen(url, timeout=2).close()
        return False
    except urllib.error.HTTPError as exc:
        return exc.code == 401
    except OSError:
        return False
