"""docker-compose.yaml's one-shot set-up (`python -m stack compose-init`, its airflow-init
service), run here with a compose-like environment against the real S3 server and the session's
Airflow database: the one part of the compose stack that runs without a Docker engine."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import run_module

from tasks.config import load
from tasks.serving.router import nginx_binary


@pytest.mark.integration
def test_compose_init_writes_the_router_config_and_imports_the_pools(
        airflow_db: None, stack_env: dict[str, str], tmp_path: Path) -> None:
    from airflow.models.pool import Pool

    airflow = str(Path(sys.executable).parent / "airflow")
    pools = load().pipeline.pools
    for name in pools:  # whatever an earlier test created: compose-init must make them
        if Pool.get_pool(name) is not None:
            Pool.delete_pool(name)
    router_dir = tmp_path / "router"
    env = {
        "STACK_DIR": str(tmp_path / "stack"),
        "ROUTER_URL": "http://router:8090",
        "ROUTER_INTERNAL_URL": "http://router:8091",
        "ROUTER_DIR": str(router_dir),
        "TRITON_URL": "http://localhost:8000",  # a service name in compose; one that resolves here
        "OPENAI_API_URL": "http://localhost:8003",
        "TRITON_REPOSITORY": str(tmp_path / "triton" / "models"),
        "PATH": f"{Path(airflow).parent}:{os.environ['PATH']}",
    }
    proc = run_module("stack", "compose-init", env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]

    conf = (router_dir / "nginx.conf").read_text()
    assert "listen 0.0.0.0:8090;" in conf and "listen 0.0.0.0:8091;" in conf and "server localhost:8000;" in conf and "server localhost:8003;" in conf
    checked = subprocess.run([nginx_binary(), "-t", "-p", str(router_dir), "-c", str(router_dir / "nginx.conf")],
                             capture_output=True, text=True)
    assert checked.returncode == 0, checked.stderr
    assert (tmp_path / "triton" / "models").is_dir()
    imported = {name: Pool.get_pool(name) for name in pools}
    assert {name: pool.slots if pool else None for name, pool in imported.items()} == {
        name: p.slots for name, p in pools.items()}
