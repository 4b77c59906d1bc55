"""Airflow's components run from the orchestrator venv beside this one (api-server, scheduler,
dag-processor, triggerer), their environment, and the pools the retrain DAG's steps queue in."""

from __future__ import annotations

import json
import os
import subprocess
import urllib.request
from collections.abc import Mapping

from stack.credentials import secret, steps_env
from stack.state import REPO_ROOT, ports, state_dir
from stack.supervise import Server
from tasks.config import every_line


def airflow_env() -> dict[str, str]:
    port = ports()["airflow"]
    return {
        **steps_env(),  # the steps Airflow launches reach the stack with these
        "AIRFLOW_HOME": str(REPO_ROOT),
        "AIRFLOW__API__HOST": "127.0.0.1",  # loopback only, like every server of the stack
        "AIRFLOW__API__PORT": str(port),
        "AIRFLOW__API__BASE_URL": f"http://127.0.0.1:{port}",
        "AIRFLOW__CORE__EXECUTION_API_SERVER_URL": f"http://127.0.0.1:{port}/execution/",
        # every component must sign and check task tokens with the same key
        "AIRFLOW__API_AUTH__JWT_SECRET": secret("airflow_jwt"),
        "AIRFLOW__API__SECRET_KEY": secret("airflow_api"),
    }


def _airflow_health() -> dict[str, object]:
    try:
        url = f"http://127.0.0.1:{ports()['airflow']}/api/v2/monitor/health"
        with urllib.request.urlopen(url, timeout=2) as resp:
            loaded: dict[str, object] = json.loads(resp.read())
            return loaded
    except (OSError, ValueError):
        return {}


def _airflow_component(component: str) -> Server:
    """One Airflow component, run from the orchestrator venv beside this one."""
    airflow = str(REPO_ROOT / ".venvs" / "orchestrator" / "bin" / "airflow")
    key = component.replace("-", "_")

    def healthy() -> bool:
        report = _airflow_health()
        if component == "api-server":
            return bool(report)
        state = report.get(key)
        return isinstance(state, dict) and state.get("status") == "healthy"

    # the scheduler's and triggerer's log servers bind every interface (no host setting): the
    # api-server reads the task logs from the shared local folder instead
    extra = ["--skip-serve-logs"] if component in ("scheduler", "triggerer") else []
    return Server(f"airflow-{component}", lambda: [airflow, component, *extra], airflow_env, healthy,
                  start_timeout_s=120, port="airflow" if component == "api-server" else None, isolated=False)


AIRFLOW_SERVERS = tuple(_airflow_component(c) for c in ("api-server", "scheduler", "dag-processor", "triggerer"))


def create_airflow_pools(airflow: str | None = None, env: Mapping[str, str] | None = None) -> None:
    """The pools the retrain DAGs' steps queue in (params.yaml ``pipeline.pools``, and a model
    line's own), created or resized before the scheduler starts: the scheduler never runs a task
    of a missing pool. A pool two lines name is one pool (every_line checks they define it alike)."""
    pools = {name: pool for settings in every_line().values() for name, pool in settings.pipeline.pools.items()}
    spec = {name: {"slots": pool.slots, "description": pool.description, "include_deferred": False}
            for name, pool in pools.items()}
    path = state_dir() / "airflow-pools.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(spec, indent=1))
    airflow = airflow or str(REPO_ROOT / ".venvs" / "orchestrator" / "bin" / "airflow")
    subprocess.run([airflow, "pools", "import", str(path)], env={**os.environ, **(env or airflow_env())},
                   check=True, stdout=subprocess.DEVNULL)
