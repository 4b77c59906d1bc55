"""Every way README starts the retrain DAG, through the real Airflow servers (api-server,
scheduler, dag-processor, triggerer): the CLI's `dags trigger`, the REST API with
``"logical_date": null`` and `backfill create`. The first two give runs without a logical date,
which `dag.test()` and the UI form (both fill one in) never exercise: templates that read it
fail only here, after the whole training.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import time
import urllib.parse
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from helpers import REPO_ROOT, SEED_URI

pytestmark = pytest.mark.integration

AIRFLOW = str(REPO_ROOT / ".venvs" / "orchestrator" / "bin" / "airflow")
DAG_ID = "llm_retrain"
# a short run: enough to reach register (whose arguments read the run's date), export and deploy
BACKFILL_DATE = "2026-11-01"  # the DAG's start date: test_llm_retrain's runs are 11-08, 11-15, 11-22
CONF = {"raw_data_uri": SEED_URI, "num_shards": 1, "train_max_steps": 12}  # 12: apart from other tests' runs


class AirflowApi:
    """The REST API v2 of the test's api-server, with a JWT from the simple auth manager."""

    def __init__(self, base_url: str, passwords_file: Path) -> None:
        self.base_url = base_url
        password = json.loads(passwords_file.read_text())["admin"]
        token = self.call("POST", "/auth/token", {"username": "admin", "password": password}, auth=False)
        self.token = token["access_token"]

    def call(self, method: str, path: str, body: Any = None, auth: bool = True) -> Any:
        request = urllib.request.Request(
            self.base_url + path, method=method, data=None if body is None else json.dumps(body).encode(),
            headers={"Content-Type": "application/json",
                     **({"Authorization": f"Bearer {self.token}"} if auth else {})},
        )
        with urllib.request.urlopen(request, timeout=30) as resp:
            return json.loads(resp.read() or b"null")


def wait_for(what: str, probe: Any, timeout_s: float, every_s: float = 2.0) -> Any:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            found = probe()
        except OSError:
            found = None
        if found:
            return found
        time.sleep(every_s)
    raise AssertionError(f"timed out after {timeout_s:.0f}s waiting for {what}")


@pytest.fixture(scope="module")
def airflow_api(airflow_db: None, seeded_raw: str, stack_env: dict[str, str],
                tmp_path_factory: pytest.TempPathFactory) -> Iterator[AirflowApi]:
    """Airflow's four components on the session's database and port. Steps get a params file
    whose gate passes a 10-step model (register must run for this test to mean anything) and
    whose canary does not judge latency."""
    from stack import servers

    params = yaml.safe_load((REPO_ROOT / "params.yaml").read_text())
    # (the loosest values the trigger form accepts: an invalid Param default keeps the DAG from loading)
    params["evaluate"].update(max_eval_perplexity=1e9, min_eval_accuracy=0.0, max_regression=1.0)
    # three runs train and canary at once on a small machine: latency there says nothing about
    # the models (tests/tasks/test_serving.py tests the latency rollback); this test is about
    # how runs are triggered
    params["canary"].update(max_latency_ratio=1e9)
    relaxed = tmp_path_factory.mktemp("trigger") / "params.yaml"
    relaxed.write_text(yaml.safe_dump(params))
    saved = dict(os.environ)
    os.environ["PIPELINE_PARAMS"] = str(relaxed)  # inherited by the servers and so by every step
    try:
        servers.create_airflow_pools()  # as `make up` does: the scheduler runs no task of a missing pool
        for server in servers.AIRFLOW_SERVERS:
            server.start()
        os.environ.clear()
        os.environ.update(saved)
        api = AirflowApi(f"http://127.0.0.1:{servers.ports()['airflow']}",
                         Path(os.environ["AIRFLOW__CORE__SIMPLE_AUTH_MANAGER_PASSWORDS_FILE"]))
        wait_for("the dag-processor to serialize the DAG", lambda: api.call("GET", f"/api/v2/dags/{DAG_ID}"), 120)
        yield api
    finally:
        os.environ.clear()
        os.environ.update(saved)
        for server in reversed(servers.AIRFLOW_SERVERS):
            server.stop()


def airflow_cli(*args: str, attempts: int = 1) -> str:
    env = {**os.environ, "AIRFLOW_HOME": str(REPO_ROOT)}
    for attempt in range(1, attempts + 1):
        proc = subprocess.run([AIRFLOW, *args], env=env, capture_output=True, text=True, timeout=120, cwd=REPO_ROOT)
        if proc.returncode == 0 or attempt == attempts or "database is locked" not in proc.stderr:
            break
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout


def registered_version(run_id: str) -> dict[str, str]:
    """Tags of the model version the run registered, as MLflow's REST API reports them."""
    query = urllib.parse.urlencode({"filter": f"tags.dag_run = '{DAG_ID}/{run_id}'"})
    url = f"{os.environ['MLFLOW_TRACKING_URI']}/api/2.0/mlflow/model-versions/search?{query}"
    with urllib.request.urlopen(url, timeout=10) as resp:
        versions = json.loads(resp.read()).get("model_versions", [])
    assert len(versions) == 1, versions
    return {t["key"]: t["value"] for t in versions[0]["tags"]}


def test_cli_rest_and_backfill_runs_reach_register(airflow_api: AirflowApi) -> None:
    airflow_cli("dags", "unpause", DAG_ID)
    # a date no other test runs: a backfill skips dates that already have a run (reprocess "none").
    # On SQLite `backfill create` can fail with "database is locked" whatever the lock wait: it
    # reads, then writes in one SAVEPOINT, and a scheduler commit in between makes its snapshot
    # stale (SQLITE_BUSY_SNAPSHOT, raised at once). Airflow removes the half-made backfill on that
    # error so that it can be rerun, as README tells users; PostgreSQL does not fail so.
    airflow_cli("backfill", "create", "--dag-id", DAG_ID, "--from-date", BACKFILL_DATE, "--to-date", BACKFILL_DATE,
                "--dag-run-conf", json.dumps({**CONF, "end_date": "2026-11-20"}), attempts=3)
    airflow_cli("dags", "trigger", DAG_ID, "-c", json.dumps({**CONF, "end_date": "2026-11-22"}))
    rest = airflow_api.call("POST", f"/api/v2/dags/{DAG_ID}/dagRuns",
                            {"logical_date": None, "conf": {**CONF, "end_date": "2026-11-21"}})
    assert rest["logical_date"] is None

    def ours() -> list[dict[str, Any]]:
        runs = airflow_api.call("GET", f"/api/v2/dags/{DAG_ID}/dagRuns?limit=100")["dag_runs"]
        return [r for r in runs if r["conf"].get("train_max_steps") == CONF["train_max_steps"]]

    wait_for("the backfill to create its run", lambda: len(ours()) == 3, timeout_s=60)

    def finished() -> list[dict[str, Any]] | None:
        runs = ours()
        return runs if all(r["state"] in ("success", "failed") for r in runs) else None

    runs = wait_for("three runs to finish", finished, timeout_s=900, every_s=5)
    by_type = {r["run_type"]: r for r in runs}
    assert set(by_type) == {"manual", "backfill"} and len(runs) == 3
    for run in runs:
        tis = airflow_api.call("GET", f"/api/v2/dags/{DAG_ID}/dagRuns/{run['dag_run_id']}/taskInstances")
        states = {ti["task_id"]: ti["state"] for ti in tis["task_instances"]}
        assert run["state"] == "success" and states["register"] == "success", (run["dag_run_id"], states)
        tags = registered_version(run["dag_run_id"])
        # a run without a logical date is dated by when it was triggered
        when = run["logical_date"] or run["run_after"]
        assert tags["logical_date"] == when[:10], (run["dag_run_id"], tags)
        assert tags["data_version"].startswith(f"data-{run['conf']['end_date']}-7d-")
    assert sum(r["logical_date"] is None for r in runs) == 2


def test_airflow_listens_on_loopback_only(airflow_api: AirflowApi) -> None:
    """No component (nor a child of one, such as a log server) accepts connections from
    outside the machine."""
    import psutil

    from stack import servers

    listening = []
    for server in servers.AIRFLOW_SERVERS:
        pid = server.pid()
        assert pid is not None, f"{server.name} is not running"
        root = psutil.Process(pid)
        for proc in [root, *root.children(recursive=True)]:
            with contextlib.suppress(psutil.NoSuchProcess):
                listening += [(server.name, c.laddr.ip, c.laddr.port) for c in proc.net_connections(kind="inet")
                              if c.status == psutil.CONN_LISTEN]
    assert listening, "no listening socket found: the check would prove nothing"
    exposed = [entry for entry in listening if entry[1] not in ("127.0.0.1", "::1")]
    assert not exposed, exposed
