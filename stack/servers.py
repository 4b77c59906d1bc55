"""The stack's servers in start order, and bringing them up, down, and reporting their health (see
``python -m stack --help``); docker-compose.yaml's one-shot set-up."""

from __future__ import annotations

import os
import shutil
import sys
import urllib.parse
from pathlib import Path

from stack.airflow_servers import AIRFLOW_SERVERS, create_airflow_pools
from stack.credentials import client_env, secret, write_env_file
from stack.mlflow_server import ensure_mlflow_pipeline_user, mlflow_command, mlflow_env
from stack.prometheus import asks_for_login, prometheus_command, pushgateway_command
from stack.seaweedfs import create_buckets, s3_healthy, seaweedfs_command
from stack.serving import (
    ROUTE_READ_ERRORS,
    front_current,
    openai_api_command,
    openai_api_env,
    publish_saved_route,
    reconcile_serving,
    refresh_router,
    route_versions_ready,
    router_command,
    router_current,
    serving_client,
    triton_command,
    triton_env,
)
from stack.state import ports
from stack.supervise import Server, StackError, http_ok, stop_servers

SERVERS = (
    Server("seaweedfs", seaweedfs_command, dict, s3_healthy, start_timeout_s=60, port="s3"),
    Server(
        "mlflow",
        mlflow_command,
        mlflow_env,
        lambda: http_ok(f"{client_env()['MLFLOW_TRACKING_URI']}/health"),
        start_timeout_s=120,
        port="mlflow",
    ),
    Server("triton", triton_command, triton_env,
           lambda: http_ok(f"{client_env()['TRITON_URL']}/v2/health/ready"), start_timeout_s=60, port="triton_http"),
    Server("openai-api", openai_api_command, openai_api_env,
           lambda: front_current(f"http://127.0.0.1:{ports()['openai_api']}"), start_timeout_s=30, port="openai_api"),
    Server("router", router_command, dict, lambda: all(router_current(client_env()[url])
                                                        for url in ("ROUTER_URL", "ROUTER_INTERNAL_URL")),
           start_timeout_s=20, port="router", refresh=refresh_router),
    Server("pushgateway", pushgateway_command, dict,
           lambda: asks_for_login("pushgateway", "/-/ready"), start_timeout_s=20, port="pushgateway"),
    Server("prometheus", prometheus_command, dict,
           lambda: asks_for_login("prometheus", "/-/ready"), start_timeout_s=30, port="prometheus"),
)


def init_compose_stack() -> None:
    """docker-compose.yaml's one-shot set-up (its airflow-init service, after ``airflow db
    migrate``), from that container's environment: the buckets, the router's config (listening
    on the compose network, Triton and the OpenAI front by service name), the model repository
    folder, the pools."""
    env = dict(os.environ)
    create_buckets(env)
    router, triton = urllib.parse.urlsplit(env["ROUTER_URL"]), urllib.parse.urlsplit(env["TRITON_URL"])
    openai, internal = urllib.parse.urlsplit(env["OPENAI_API_URL"]), urllib.parse.urlsplit(env["ROUTER_INTERNAL_URL"])
    from tasks.serving.router import Listeners, Upstreams, write_router_config

    write_router_config(Path(env["ROUTER_DIR"]), Listeners(router.port or 80, internal.port or 80, host="0.0.0.0"),
                        Upstreams(triton.port or 80, openai.port or 80, triton_host=triton.hostname or "triton",
                                  openai_host=openai.hostname or "openai-api"))
    Path(env["TRITON_REPOSITORY"]).mkdir(parents=True, exist_ok=True)
    create_airflow_pools(shutil.which("airflow") or "airflow", env)


def up(with_airflow: bool = False) -> dict[str, str]:
    for server in SERVERS:
        if server.name == "router":
            try:
                reconcile_serving()
            except StackError as exc:  # the rest of the stack still comes up: a deploy repairs serving
                print(f"warning: {exc}; requests for them fail until a deploy", file=sys.stderr)
        server.start()
        if server.name == "seaweedfs":
            create_buckets()
        if server.name == "mlflow":
            ensure_mlflow_pipeline_user(client_env()["MLFLOW_TRACKING_URI"], secret("mlflow_admin"),
                                        secret("mlflow_pipeline"))
    env = write_env_file()
    publish_saved_route(env)
    if with_airflow:
        create_airflow_pools()
        for server in AIRFLOW_SERVERS:
            server.start()
    return env


def down() -> None:
    stop_servers(SERVERS + AIRFLOW_SERVERS)


def status() -> dict[str, bool]:
    running = [s for s in AIRFLOW_SERVERS if s.pid()]
    healthy = {server.name: bool(server.pid()) and server.healthy() for server in (*SERVERS, *running)}
    if healthy["triton"]:  # the route names only versions Triton has READY
        try:
            versions, ready = route_versions_ready(serving_client())
            routes = "; ".join(f"{line} versions {', '.join(map(str, served)) or 'none'}"
                               for line, served in versions.items())
            healthy[f"serving (routes: {routes})"] = ready
        except ROUTE_READ_ERRORS as exc:
            healthy[f"serving (route unreadable: {exc})"] = False
    return healthy
