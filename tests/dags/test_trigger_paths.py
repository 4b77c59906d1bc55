"""Every way docs/operations.md starts the retrain DAG, through the real Airflow servers (api-server,
scheduler, dag-processor, triggerer): the UI's trigger form driven in headless Chromium, the
CLI's `dags trigger`, the REST API with ``"logical_date": null`` and `backfill create`. The CLI
and REST give runs without a logical date, which `dag.test()` and the UI form (both fill one in)
never exercise: templates that read it fail only here, after the whole training. Screenshots of
the form and of the finished run are saved under .test-artifacts/ui/.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import json
import os
import re
import shutil
import socket
import subprocess
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from helpers import REPO_ROOT, SEED_URI, mlflow_rest, run_module
from metadata_db import LOCK_WAIT_S

pytestmark = pytest.mark.integration

AIRFLOW = str(REPO_ROOT / ".venvs" / "orchestrator" / "bin" / "airflow")
DAG_ID = "llm_retrain"
# a short run: enough to reach register (whose arguments read the run's date), export and deploy
# one training node: runs share two cores, and this test is about how runs start
CONF = {"raw_data_uri": SEED_URI, "num_shards": 1, "train_nodes": 1,
        "train_max_steps": 12}  # 12: apart from other tests' runs
# The backfill: the two newest weekly intervals (Sundays at midnight; the other DAG tests run at
# 06:00, so these dates are free), the second the newest tick: unpausing the DAG makes the scheduler
# create the newest tick's run unless one exists, and a backfill that holds it leaves none to make
# (a fixed date falls behind the calendar, and that tick's run would train a whole default chain
# beside this test's). Over raw data of its own, 14 days from the second interval's window on: the
# first interval's window (the week before it) has no data, the second's a week.
def newest_weekly_tick(now: dt.datetime) -> dt.date:
    """The newest Sunday (``@weekly``: midnight UTC) at or before ``now``."""
    return (now - dt.timedelta(days=(now.weekday() + 1) % 7)).date()


BACKFILL_TO = newest_weekly_tick(dt.datetime.now(dt.UTC))
BACKFILL_FROM = BACKFILL_TO - dt.timedelta(days=7)
BACKFILL_RAW = "s3://raw/test-backfill"
# The CLI's and the form's runs ask for weeks before that raw data: the first task of each refuses
# the window its conf names (the week before the end date)
CLI_END, CLI_WINDOW = "2026-10-31", "2026-10-24..2026-10-30"
FORM_END, FORM_WINDOW = "2026-10-24", "2026-10-17..2026-10-23"
SCREENSHOTS = REPO_ROOT / ".test-artifacts" / "ui"
REVIEWER = "reviewer"  # the approver who did not trigger the approval's run (admin did)


class AirflowApi:
    """The REST API v2 of the test's api-server, as ``user``, with a JWT from the simple auth manager."""

    def __init__(self, base_url: str, passwords_file: Path, user: str = "admin") -> None:
        self.base_url, self.passwords_file, self.user = base_url, passwords_file, user
        self.server_env: dict[str, str] = {}  # the environment Airflow's components were started in
        self.password = json.loads(passwords_file.read_text())[user]
        token = self.call("POST", "/auth/token", {"username": user, "password": self.password}, auth=False)
        self.token = token["access_token"]

    def as_user(self, user: str) -> AirflowApi:
        return AirflowApi(self.base_url, self.passwords_file, user)

    def call(self, method: str, path: str, body: Any = None, auth: bool = True) -> Any:
        request = urllib.request.Request(
            self.base_url + path, method=method, data=None if body is None else json.dumps(body).encode(),
            headers={"Content-Type": "application/json",
                     **({"Authorization": f"Bearer {self.token}"} if auth else {})},
        )
        log = api_server_log()
        for attempt in (1, 2, 3):
            logged = log.stat().st_size if log.exists() else 0
            try:
                # longer than the api-server's own wait for SQLite's write lock (plugins/metadata_db.py):
                # a trigger queued behind the scheduler's commits is answered, not cut off by the client
                with urllib.request.urlopen(request, timeout=2 * LOCK_WAIT_S) as resp:
                    return json.loads(resp.read() or b"null")
            except urllib.error.HTTPError as exc:
                if exc.code < 500:
                    raise
                # a server error says why only in the api-server's log, which the session removes
                why = read_from(log, logged)
                # SQLite's stale-snapshot error is raised at once, whatever the lock wait, and rolls
                # the request back (plugins/metadata_db.py): asked again, as for `backfill create`
                if "database is locked" in why and attempt < 3:
                    continue
                raise AssertionError(f"{method} {path}: {exc.code} {exc.read()[:2000]!r}\n"
                                     f"api-server log meanwhile:\n{why[-6000:]}") from exc
        raise AssertionError("unreachable")


def api_server_log() -> Path:
    from stack.airflow_servers import AIRFLOW_SERVERS

    return AIRFLOW_SERVERS[0].log_file


def read_from(path: Path, offset: int) -> str:
    """What ``path`` gained after ``offset`` (its size before a request)."""
    if not path.exists():
        return f"({path} missing)"
    with path.open("rb") as log:
        log.seek(offset)
        return log.read().decode(errors="replace")


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


class StatsdReceiver:
    """What Airflow's components send to StatsD (UDP on loopback), kept as metric names: the
    input that docker-compose.yaml's statsd-exporter maps to Prometheus series."""

    def __init__(self) -> None:
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        self.sock.bind(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.names: set[str] = set()
        threading.Thread(target=self._receive, daemon=True).start()

    def _receive(self) -> None:
        while True:
            try:
                packet = self.sock.recv(65535)
            except OSError:  # closed
                return
            self.names |= {line.split(":", 1)[0] for line in packet.decode(errors="replace").splitlines() if line}

    def close(self) -> None:
        self.sock.close()


@pytest.fixture(scope="module")
def statsd() -> Iterator[StatsdReceiver]:
    receiver = StatsdReceiver()
    yield receiver
    receiver.close()


@pytest.fixture(scope="module")
def airflow_api(airflow_db: None, seeded_raw: str, stack_env: dict[str, str], statsd: StatsdReceiver,
                tmp_path_factory: pytest.TempPathFactory) -> Iterator[AirflowApi]:
    """Airflow's four components on the session's database and port, with two users (admin and
    reviewer). Steps get a params file whose gate passes a 12-step model (register must run for
    this test to mean anything), whose canary does not judge latency, and that deploys as a
    deployment requiring a person's approval: from the approvers, never the run's triggering user."""
    from stack.airflow_servers import AIRFLOW_SERVERS, create_airflow_pools
    from stack.state import ports
    from stack.supervise import stop_servers

    params = yaml.safe_load((REPO_ROOT / "params.yaml").read_text())
    # the gate, and the limits a run's Params may not loosen it past (a Param default outside
    # them would keep the DAG from loading; the settings refuse such a file)
    gate = {"max_eval_perplexity": 1e9, "min_eval_accuracy": 0.0, "max_regression": 1.0}
    params["evaluate"].update(gate, limits=gate)
    params["canary"]["approval"].update(required=True, approvers=["admin", REVIEWER], four_eyes=True)
    # three runs train and canary at once on a small machine: latency there says nothing about
    # the models (tests/tasks/test_serving.py tests the latency rollback); this test is about
    # how runs are triggered
    params["canary"].update(max_latency_ratio=1e9, text_max_latency_ratio=1e9)
    # runs share two cores: lighter than the defaults where that changes nothing checked
    # here (the evaluation, export parity and canary steps have tests of their own)
    params["evaluate"]["max_eval_tokens"] = 4096
    params["export"]["parity_windows"] = 4
    params["canary"].update(steps=[100], step_duration_s=3)
    # no shadow stage before the hold (tests/tasks/test_serving.py tests the shadow): the two
    # deploys of the held run hold at 0% once the new version is loaded and warmed
    params["canary"]["shadow"] = False
    relaxed = tmp_path_factory.mktemp("trigger") / "params.yaml"
    relaxed.write_text(yaml.safe_dump(params))
    saved = dict(os.environ)
    os.environ["PIPELINE_PARAMS"] = str(relaxed)  # inherited by the servers and so by every step
    # Airflow's own metrics, as docker-compose.yaml sends them to its statsd-exporter
    os.environ.update(AIRFLOW__METRICS__STATSD_ON="True", AIRFLOW__METRICS__STATSD_HOST="127.0.0.1",
                      AIRFLOW__METRICS__STATSD_PORT=str(statsd.port), AIRFLOW__METRICS__STATSD_PREFIX="airflow")
    # a second person, who may answer the approval (the simple auth manager's role "user" edits DAG runs)
    os.environ["AIRFLOW__CORE__SIMPLE_AUTH_MANAGER_USERS"] = f"admin:admin,{REVIEWER}:user"
    try:
        create_airflow_pools()  # as `make up` does: the scheduler runs no task of a missing pool
        for server in AIRFLOW_SERVERS:
            server.start()
        server_env = dict(os.environ)
        os.environ.clear()
        os.environ.update(saved)
        api = AirflowApi(f"http://127.0.0.1:{ports()['airflow']}",
                         Path(os.environ["AIRFLOW__CORE__SIMPLE_AUTH_MANAGER_PASSWORDS_FILE"]))
        api.server_env = server_env  # to start a component again, as it was
        wait_for("the dag-processor to serialize the DAG", lambda: api.call("GET", f"/api/v2/dags/{DAG_ID}"), 120)
        yield api
    finally:
        os.environ.clear()
        os.environ.update(saved)
        stop_servers(AIRFLOW_SERVERS)


def airflow_cli(*args: str, attempts: int = 1) -> str:
    env = {**os.environ, "AIRFLOW_HOME": str(REPO_ROOT)}
    for attempt in range(1, attempts + 1):
        proc = subprocess.run([AIRFLOW, *args], env=env, capture_output=True, text=True, timeout=120, cwd=REPO_ROOT)
        if proc.returncode == 0 or attempt == attempts or "database is locked" not in proc.stderr:
            break
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout


@contextlib.contextmanager
def signed_in_browser(api: AirflowApi) -> Iterator[Any]:
    """A headless Chromium page signed in to the UI as docs/operations.md tells a person to: the
    api's user (admin), the password Airflow generated into its passwords file."""
    from playwright.sync_api import sync_playwright

    chromium = shutil.which("chromium")
    assert chromium, "chromium: not installed (`make env` installs the Debian package on a fresh machine)"
    with sync_playwright() as playwright:
        # --no-sandbox: Chromium's sandbox refuses to start as root, which CI machines run as
        browser = playwright.chromium.launch(executable_path=chromium, args=["--no-sandbox"], timeout=180_000)
        try:
            page = browser.new_page(viewport={"width": 1400, "height": 1000})
            # each wait up to 3 min, not playwright's 30 s: make test runs this half at idle CPU
            # priority beside the timed tests (tests/run_beside.py), and the UI's server and the
            # browser may wait that long for a core
            page.set_default_timeout(180_000)
            page.goto(f"{api.base_url}/dags/{DAG_ID}")  # redirected to the login form
            page.fill("input[name=username]", api.user)
            page.fill("input[name=password]", api.password)
            page.click("button:has-text('Sign in')")
            page.wait_for_url(f"**/dags/{DAG_ID}")
            yield page
        finally:
            browser.close()


def trigger_from_the_form(api: AirflowApi, values: dict[str, str], skip_deploy: bool) -> str:
    """Open the DAG's trigger form, try an out-of-bounds value, fill the Params the way a person
    types them, trigger; returns the new run's id (the page the UI opens next)."""
    with signed_in_browser(api) as page:
        page.get_by_role("button", name="Trigger Dag").click()
        form = page.get_by_role("dialog")

        def field(param: str) -> Any:  # the UI names each Param's input element_<name>
            return form.locator(f"[name=element_{param}]")

        field("train_max_steps").fill("0")  # below the Param's minimum of 1
        field("train_max_steps").blur()
        assert field("train_max_steps").input_value() == "1"  # the form clamps it, no task sees 0
        for param, value in values.items():
            field(param).fill(value)
            field(param).blur()
        if skip_deploy:
            form.locator("label:has([name=element_skip_deploy])").click()
        assert field("skip_deploy").is_checked() == skip_deploy
        SCREENSHOTS.mkdir(parents=True, exist_ok=True)
        form.screenshot(path=SCREENSHOTS / "1-trigger-form.png")
        form.get_by_role("button", name="Trigger", exact=True).click()
        page.wait_for_url(f"**/dags/{DAG_ID}/runs/**")
        return urllib.parse.unquote(page.url.rsplit("/runs/", 1)[1])


def screenshot_run(api: AirflowApi, run_id: str) -> None:
    with signed_in_browser(api) as page:
        page.goto(f"{api.base_url}/dags/{DAG_ID}/runs/{urllib.parse.quote(run_id)}")
        page.get_by_text("Success").first.wait_for()
        page.screenshot(path=SCREENSHOTS / "2-finished-run.png")


def registered_version(run_id: str) -> tuple[str, dict[str, str]]:
    """The model version the run registered and its tags, as MLflow's REST API reports them."""
    query = urllib.parse.urlencode({"filter": f"tags.dag_run = '{DAG_ID}/{run_id}'"})
    versions = mlflow_rest(f"/api/2.0/mlflow/model-versions/search?{query}").get("model_versions", [])
    assert len(versions) == 1, versions
    return versions[0]["version"], {t["key"]: t["value"] for t in versions[0]["tags"]}


def seed_two_weeks() -> None:
    end = BACKFILL_TO + dt.timedelta(days=6)
    proc = run_module("tasks.seed", "--output", BACKFILL_RAW, "--end-date", end.isoformat(),
                      "--heldout-output", f"{BACKFILL_RAW}-heldout", "--set", "days=14", "--set", "max_documents=2700")
    assert proc.returncode == 0, proc.stderr[-3000:]


def check_a_run_cannot_weaken_the_approval_nor_the_gate(api: AirflowApi) -> None:
    """What the deployment requires (params.yaml: canary.approval.required, evaluate.limits), a
    trigger cannot undo: the REST API refuses the run (400, naming the Param), none is created."""
    for conf, why in (({"approval": False}, "Invalid input for param approval: True was expected"),
                      ({"max_regression": 2.0}, "Invalid input for param max_regression: 2.0 is greater than the "
                                                "maximum of 1.0")):
        with pytest.raises(urllib.error.HTTPError) as refused:
            api.call("POST", f"/api/v2/dags/{DAG_ID}/dagRuns", {"logical_date": None, "conf": {**CONF, **conf}})
        assert refused.value.code == 400 and why in refused.value.read().decode(), conf


# two runs of the whole chain at once on two cores (three more fail at their first task), then the held rollout twice: its waits
# below add up to 36 minutes, past the suite's default per-test limit
@pytest.mark.timeout(2400)
def test_ui_cli_rest_and_backfill_runs_reach_register(airflow_api: AirflowApi) -> None:
    check_a_run_cannot_weaken_the_approval_nor_the_gate(airflow_api)
    seed_two_weeks()
    # docs/operations.md's backfill: the scheduler runs one run per interval, each on its own window. Created
    # while the DAG is paused: unpausing makes the scheduler create the newest weekly tick's run
    # unless one exists (it skips a date the backfill holds; the backfill would skip its). On SQLite
    # `backfill create` can fail with "database is locked" whatever the lock wait: it reads, then
    # writes in one SAVEPOINT, and a scheduler commit in between makes its snapshot stale
    # (SQLITE_BUSY_SNAPSHOT, raised at once). Airflow removes the half-made backfill on that error
    # so that it can be rerun, as docs/operations.md tells users; PostgreSQL does not fail so.
    airflow_cli("backfill", "create", "--dag-id", DAG_ID, "--from-date", BACKFILL_FROM.isoformat(),
                "--to-date", BACKFILL_TO.isoformat(),
                "--dag-run-conf", json.dumps({**CONF, "raw_data_uri": BACKFILL_RAW, "skip_deploy": True}),
                attempts=3)
    airflow_cli("dags", "unpause", DAG_ID)
    # non-default Params typed into the form, for a week with no raw data: its first task fails
    # naming the window the form asked for, which shows the typed Params reaching the tasks (a run
    # with a logical date, as the backfill's whole one and dag.test()'s); the run skips deploy (its
    # form switch)
    from_the_form = trigger_from_the_form(
        airflow_api, {**{name: str(value) for name, value in CONF.items()}, "end_date": FORM_END,
                      "raw_data_uri": BACKFILL_RAW}, skip_deploy=True)
    # the two runs without a logical date: the REST API's, triggered by admin, deploys (deploy's
    # arguments read the run's date too) and waits for a person's approval (required here: no
    # Param asks for it). The CLI's makes the same kind of run (manual, no logical date, the conf
    # as given) for a week with no raw data: its first task fails naming the window the CLI's conf
    # asked for, which shows that conf reaching the tasks; the whole chain runs twice on two
    # cores, not four times
    rest = airflow_api.call("POST", f"/api/v2/dags/{DAG_ID}/dagRuns",
                            {"logical_date": None, "conf": {**CONF, "end_date": "2026-11-22"}})
    assert rest["logical_date"] is None and "approval" not in rest["conf"]
    airflow_cli("dags", "trigger", DAG_ID, "-c", json.dumps({**CONF, "raw_data_uri": BACKFILL_RAW, "end_date": CLI_END}))

    def ours() -> list[dict[str, Any]]:
        runs = airflow_api.call("GET", f"/api/v2/dags/{DAG_ID}/dagRuns?limit=100")["dag_runs"]
        return [r for r in runs if r["conf"].get("train_max_steps") == CONF["train_max_steps"]]

    seen: list[tuple[str, str | None, str]] = []

    def all_created() -> bool:
        seen[:] = [(r["run_type"], r["logical_date"], r["state"]) for r in ours()]
        return len(seen) == 5

    try:
        wait_for("the backfill to create its runs", all_created, timeout_s=180)
    except AssertionError as exc:
        raise AssertionError(f"{exc}; runs seen: {seen}") from None

    approval_run = rest["dag_run_id"]
    reviewer = airflow_api.as_user(REVIEWER)

    def finished() -> list[dict[str, Any]] | None:
        if waiting_for_a_person(airflow_api, approval_run):
            # admin triggered it: their own approval is refused, the question waits for another
            # approver, who rolls it back through the REST API
            check_the_triggering_user_cannot_answer(airflow_api, approval_run)
            answer_through_the_api(reviewer, approval_run, "Roll back")
        runs = ours()
        return runs if all(r["state"] in ("success", "failed") for r in runs) else None

    runs = wait_for("the five runs to finish", finished, timeout_s=1200, every_s=5)
    backfill = sorted((r for r in runs if r["run_type"] == "backfill"), key=lambda r: r["logical_date"])
    manual = [r for r in runs if r["run_type"] == "manual"]
    assert [r["logical_date"][:10] for r in backfill] == [BACKFILL_FROM.isoformat(), BACKFILL_TO.isoformat()]
    # and no run of the newest tick beside them (the scheduler's, on unpausing: the backfill holds it)
    assert not [r for r in airflow_api.call("GET", f"/api/v2/dags/{DAG_ID}/dagRuns?limit=100")["dag_runs"]
                if r["run_type"] == "scheduled"], "the scheduler made a run of the newest tick"
    assert len(manual) == 3 and from_the_form in {r["dag_run_id"] for r in manual}
    assert sum(r["logical_date"] is None for r in manual) == 2
    from_the_cli = next(r for r in manual if r["conf"].get("end_date") == CLI_END)
    assert from_the_cli["logical_date"] is None and from_the_cli["conf"]["raw_data_uri"] == BACKFILL_RAW, from_the_cli
    form = next(r for r in manual if r["dag_run_id"] == from_the_form)
    assert form["logical_date"] is not None and form["conf"]["skip_deploy"] is True, form
    assert {key: form["conf"][key] for key in CONF if key != "raw_data_uri"} == \
        {key: value for key, value in CONF.items() if key != "raw_data_uri"}, form["conf"]

    # the backfill's interval with no raw data, and the CLI's and the form's weeks without any:
    # each fails its first task once (bad input is not retried), one line naming the window
    check_failed_at_snapshot(airflow_api, backfill[0], f"{BACKFILL_FROM - dt.timedelta(days=7)}.."
                                                       f"{BACKFILL_FROM - dt.timedelta(days=1)}")
    check_failed_at_snapshot(airflow_api, from_the_cli, CLI_WINDOW)
    check_failed_at_snapshot(airflow_api, form, FORM_WINDOW)

    whole = [backfill[1], next(r for r in manual if r["dag_run_id"] == approval_run)]
    for run in whole:
        states = task_states(airflow_api, run)
        # (the tasks that did not succeed, named: pytest cuts a long dict short)
        assert run["state"] == "success" and states["register"] == "success", \
            f"{run['dag_run_id']}: {sorted((t, s) for t, s in states.items() if s != 'success')}"
        if run["dag_run_id"] != approval_run:
            assert run["conf"]["skip_deploy"] is True and states["deploy"] == "skipped", (run["conf"], states)
        else:  # deploy's arguments read the run's date too; a person rolled it back: a gate (skipped)
            assert states["deploy"] == "success" and states["approve_rollout"] == "success", (run["dag_run_id"], states)
            assert states["deploy_finish"] == "skipped", states
        _, tags = registered_version(run["dag_run_id"])
        # a run without a logical date is dated by when it was triggered
        when = run["logical_date"] or run["run_after"]
        assert tags["logical_date"] == when[:10], (run["dag_run_id"], tags)
        end = run["conf"].get("end_date") or run["logical_date"][:10]  # a backfill reads its interval's window
        assert tags["data_version"].startswith(f"data-{end}-7d-") and tags["data_end"] == end, tags
    # two runs at once, two windows: two data versions and two registered versions, neither
    # overwriting the other's
    registered = dict(registered_version(r["dag_run_id"]) for r in whole)
    assert len(registered) == 2 and len({tags["data_version"] for tags in registered.values()}) == 2, registered
    screenshot_run(airflow_api, backfill[1]["dag_run_id"])
    check_the_approval(airflow_api, approval_run)


def check_failed_at_snapshot(api: AirflowApi, run: dict[str, Any], window: str) -> None:
    """``run`` failed its first task, once, with one line naming ``window`` of the backfill's raw
    data; nothing after it ran but the teardowns (nothing held, nothing done; the report)."""
    states = task_states(api, run)
    assert run["state"] == "failed" and states["snapshot"] == "failed", (run["dag_run_id"], states)
    assert {states[t] for t in states if t not in ("snapshot", "release_hold", "drift_recheck", "report")} <= {
        "upstream_failed"}, states
    assert states["drift_recheck"] == "skipped", states  # runs however the rollout ended: no drift to check
    assert states["release_hold"] == "success", states
    path = f"/api/v2/dags/{DAG_ID}/dagRuns/{quoted(run['dag_run_id'])}/taskInstances/snapshot"
    log = json.dumps(api.call("GET", f"{path}/logs/1?full_content=true"))
    assert f"{BACKFILL_RAW}: no partitions with data for {window} (empty interval)" in log, run["dag_run_id"]
    assert api.call("GET", path)["try_number"] == 1


def waiting_for_a_person(api: AirflowApi, run_id: str) -> dict[str, Any] | None:
    """The approval task's question once it waits for an answer (in Airflow's Required Actions)."""
    try:
        detail: dict[str, Any] = api.call("GET", f"/api/v2/dags/{DAG_ID}/dagRuns/{quoted(run_id)}/taskInstances/"
                                                 "approve_rollout/-1/hitlDetails")
    except urllib.error.HTTPError:  # 404: not asked yet
        return None
    waiting = detail["task_instance"]["state"] == "awaiting_input" and not detail["response_received"]
    return detail if waiting else None


def answer_through_the_api(api: AirflowApi, run_id: str, option: str) -> None:
    answered = api.call("PATCH", f"/api/v2/dags/{DAG_ID}/dagRuns/{quoted(run_id)}/taskInstances/approve_rollout/-1/"
                                 "hitlDetails", {"chosen_options": [option], "params_input": {}})
    assert answered["chosen_options"] == [option] and answered["responded_by"]["name"] == api.user, answered


def check_the_triggering_user_cannot_answer(api: AirflowApi, run_id: str) -> None:
    """``api``'s user triggered the run (four_eyes): the question names the other approver only,
    and Airflow refuses their own Promote (403); the question still waits."""
    question = waiting_for_a_person(api, run_id)
    assert question and question["assigned_users"] == [{"id": REVIEWER, "name": REVIEWER}], question
    with pytest.raises(urllib.error.HTTPError) as refused:
        answer_through_the_api(api, run_id, "Promote")
    assert refused.value.code == 403 and f"User={api.user} (id={api.user}) is not a respondent" in \
        refused.value.read().decode()
    assert waiting_for_a_person(api, run_id), "the refused answer ended the wait"


def answer_in_the_ui(api: AirflowApi, run_id: str, option: str) -> None:
    """The run's Required Action page, as a person opens it: the question, then the option's button."""
    with signed_in_browser(api) as page:
        page.goto(f"{api.base_url}/dags/{DAG_ID}/runs/{quoted(run_id)}/tasks/approve_rollout/required_actions")
        button = page.get_by_test_id(f"hitl-option-{option}")
        button.wait_for()
        page.get_by_text("holds at").first.wait_for()  # deploy's account of the rollout, in the body
        page.screenshot(path=SCREENSHOTS / "3-approval.png", full_page=True)
        button.click()
        wait_for("the answer to be recorded", lambda: not waiting_for_a_person(api, run_id), timeout_s=180,
                 every_s=1)


def check_the_approval(api: AirflowApi, run_id: str) -> None:
    """The REST API's run held its rollout for a person; admin, who triggered it, could not
    answer; the reviewer rolled it back through the REST API (above). Its deploy cleared and run
    again holds anew; the scheduler restarted meanwhile; admin is refused again; the reviewer
    approves in the UI: the rollout goes on, the version is promoted, and the report and the
    version's tags say who decided what and when."""
    from stack.airflow_servers import AIRFLOW_SERVERS

    version, _ = registered_version(run_id)
    report = api.call("GET", f"/api/v2/dags/{DAG_ID}/dagRuns/{quoted(run_id)}/taskInstances/report/xcomEntries/"
                             "return_value")["value"]
    assert report["verdict"] == "rolled back" and f"rolled back by {REVIEWER}" in report["outcome"], report
    api.call("POST", f"/api/v2/dags/{DAG_ID}/clearTaskInstances",
             {"dry_run": False, "dag_run_id": run_id, "task_ids": ["deploy"], "include_downstream": True,
              "only_failed": False, "reset_dag_runs": True})
    question = wait_for("the rollout to hold again", lambda: waiting_for_a_person(api, run_id), timeout_s=300)
    assert question["options"] == ["Roll back", "Promote", "Extend"] and question["defaults"] == ["Roll back"]
    assert f"Version **{version}** holds at **0%**" in question["body"] and "Evaluation on held-out text" in question["body"]
    scheduler = next(s for s in AIRFLOW_SERVERS if s.name == "airflow-scheduler")
    scheduler.stop()
    saved = dict(os.environ)
    os.environ.clear()
    os.environ.update(api.server_env)
    try:
        scheduler.start()
    finally:
        os.environ.clear()
        os.environ.update(saved)
    assert waiting_for_a_person(api, run_id), "the question did not survive the scheduler's restart"
    check_the_triggering_user_cannot_answer(api, run_id)
    answer_in_the_ui(api.as_user(REVIEWER), run_id, "Promote")

    def run_finished() -> dict[str, Any] | None:
        found: dict[str, Any] = api.call("GET", f"/api/v2/dags/{DAG_ID}/dagRuns/{quoted(run_id)}")
        return found if found["state"] in ("success", "failed") else None

    run = wait_for("the approved run to finish", run_finished, timeout_s=300, every_s=3)
    states = task_states(api, run)
    assert run["state"] == "success" and states["deploy_finish"] == "success", states
    _, tags = registered_version(run_id)
    assert (tags["approval.decision"], tags["approval.by"]) == ("Promote", REVIEWER) and tags["approval.at"], tags
    report = api.call("GET", f"/api/v2/dags/{DAG_ID}/dagRuns/{quoted(run_id)}/taskInstances/report/xcomEntries/"
                             "return_value")["value"]
    assert report["verdict"] == "success" and report["outcome"] == f"version {version} serves as champion", report


def task_states(api: AirflowApi, run: dict[str, Any]) -> dict[str, str]:
    tis = api.call("GET", f"/api/v2/dags/{DAG_ID}/dagRuns/{quoted(run['dag_run_id'])}/taskInstances")
    return {ti["task_id"]: ti["state"] for ti in tis["task_instances"]}


def quoted(run_id: str) -> str:
    return urllib.parse.quote(run_id, safe="")


def statsd_exporter_glob(pattern: str) -> re.Pattern[str]:
    """statsd-exporter's glob match: ``*`` stands for one dot-separated part of the name."""
    return re.compile(r"\.".join("[^.]+" if part == "*" else re.escape(part) for part in pattern.split(".")))


def test_airflow_metrics_are_what_the_statsd_exporter_mapping_reads(airflow_api: AirflowApi,
                                                                   statsd: StatsdReceiver) -> None:
    """After the runs above: every rule of observability/statsd-mapping.yml matches metrics the
    real scheduler, dag-processor and task runners sent, so each Prometheus series it defines
    exists in the compose stack (a renamed metric in an Airflow upgrade fails here)."""
    mapping = yaml.safe_load((REPO_ROOT / "observability" / "statsd-mapping.yml").read_text())["mappings"]
    names = set(statsd.names)
    unmatched = [rule["match"] for rule in mapping if not any(statsd_exporter_glob(rule["match"]).fullmatch(n)
                                                              for n in names)]
    assert not unmatched, (unmatched, sorted(names)[:80])
    # the runs' outcomes as the dashboard reads them: successes, and the backfill's empty interval
    assert f"airflow.dagrun.duration.success.{DAG_ID}" in names and f"airflow.dagrun.duration.failed.{DAG_ID}" in names
    assert f"airflow.ti.finish.{DAG_ID}.snapshot.failed" in names


def test_airflow_listens_on_loopback_only(airflow_api: AirflowApi) -> None:
    """No component (nor a child of one, such as a log server) accepts connections from
    outside the machine."""
    import psutil

    from stack.airflow_servers import AIRFLOW_SERVERS

    listening = []
    for server in AIRFLOW_SERVERS:
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
