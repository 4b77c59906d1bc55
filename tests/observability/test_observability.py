"""Observability: the alert rules (promtool: checked and unit-tested on series), the Grafana
dashboard (every query accepted by the real Prometheus), and a run's figures pushed by the run
report reaching Prometheus through the real Pushgateway."""

from __future__ import annotations

import base64
import json
import re
import shutil
import subprocess
import time
import urllib.error
import urllib.parse
import urllib.request

import pytest
import yaml
from helpers import REPO_ROOT, prometheus_query

from tasks import report
from tasks.lib import metrics

OBSERVABILITY = REPO_ROOT / "observability"
PROMTOOL = shutil.which("promtool") or "/usr/bin/promtool"


def promtool(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([PROMTOOL, *args], cwd=OBSERVABILITY, capture_output=True, text=True)


def test_alert_rules_pass_promtool_and_their_unit_tests() -> None:
    checked = promtool("check", "rules", "alerts.yml")
    assert checked.returncode == 0, checked.stdout + checked.stderr
    tested = promtool("test", "rules", "alerts_test.yml")  # series in, expected alerts out
    assert tested.returncode == 0, tested.stdout + tested.stderr


def test_alert_rules_read_the_figures_the_report_pushes() -> None:
    """A renamed figure would leave an alert silently never firing."""
    rules = (OBSERVABILITY / "alerts.yml").read_text()
    used = {word for word in rules.replace("(", " ").replace(")", " ").split() if word.startswith("llm_pipeline_")}
    assert used and used <= set(report.FIGURE_HELP)
    dashboard = (OBSERVABILITY / "grafana-dashboard.json").read_text()
    assert set(re.findall(r"llm_pipeline_\w+", dashboard)) <= set(report.FIGURE_HELP)
    # Airflow's own series: names the StatsD exporter's mapping produces (histograms add suffixes)
    mapped = {rule["name"] for rule in yaml.safe_load((OBSERVABILITY / "statsd-mapping.yml").read_text())["mappings"]}
    airflow = {re.sub(r"_(bucket|sum|count)$", "", name) for name in re.findall(r"airflow_\w+", dashboard)}
    assert airflow and airflow <= mapped, airflow - mapped


def test_exposition_and_group_path() -> None:
    text = metrics.exposition({"a_ratio": 0.5, "b": None, "c": float("nan"), "d_total": 3}, {"a_ratio": "a share"})
    assert text == "# HELP a_ratio a share\n# TYPE a_ratio gauge\na_ratio 0.5\n# HELP d_total d_total\n" \
                   "# TYPE d_total gauge\nd_total 3.0\n"
    path = metrics.group_path({"dag_id": "llm_retrain", "run_id": "manual__2026-11-22T00:00:00+00:00/x"})
    encoded = path.rsplit("/", 1)[1]
    assert path.startswith("/metrics/job/llm_pipeline/dag_id@base64/")
    assert base64.urlsafe_b64decode(encoded + "=" * (-len(encoded) % 4)).decode().endswith("+00:00/x")


def test_the_route_alert_reads_the_series_deploy_pushes() -> None:
    """The versions the route serves, one series per track, one HELP for the name; the alert
    rule reads that name and the model label (a rename would leave it silently never firing)."""
    from tasks.serving import platforms

    name = platforms.ROUTE_METRIC
    text = metrics.exposition({f'{name}{{track="stable",version="4"}}': 1.0, f'{name}{{track="canary",version="5"}}': 1.0},
                              {name: "routed"})
    assert text == (f'# HELP {name} routed\n# TYPE {name} gauge\n{name}{{track="stable",version="4"}} 1.0\n'
                    f'{name}{{track="canary",version="5"}} 1.0\n')
    rules = yaml.safe_load((OBSERVABILITY / "alerts.yml").read_text())["groups"]
    expr = next(r["expr"] for g in rules for r in g["rules"] if r.get("alert") == "LLMServingRouteVersionNotServed")
    assert expr.split()[0] == f'{name}{{model!=""}}' and "on (model, version)" in expr


def test_push_without_a_gateway_is_skipped(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("PUSHGATEWAY_URL", raising=False)
    assert metrics.push({"dag_id": "d"}, {"x": 1.0}, {}) is False
    monkeypatch.setenv("PUSHGATEWAY_URL", "http://127.0.0.1:9")  # nothing listens: logged, not raised
    assert metrics.push({"dag_id": "d"}, {"x": 1.0}, {}) is False


@pytest.mark.integration
def test_dashboard_queries_are_valid_promql(stack_env: dict[str, str]) -> None:
    dashboard = json.loads((OBSERVABILITY / "grafana-dashboard.json").read_text())
    panels = dashboard["panels"]
    assert len({p["id"] for p in panels}) == len(panels) and dashboard["uid"]
    assert {v["name"] for v in dashboard["templating"]["list"]} == {"datasource"}
    for panel in panels:
        assert panel["datasource"]["uid"] == "${datasource}" and panel["targets"], panel["title"]
        assert set(panel["gridPos"]) == {"x", "y", "w", "h"} and panel["gridPos"]["x"] + panel["gridPos"]["w"] <= 24
        for target in panel["targets"]:
            answer = prometheus_query(target["expr"], stack_env)  # 400 on a syntax error
            assert answer["status"] == "success", (panel["title"], answer)


@pytest.mark.integration
def test_a_runs_figures_reach_prometheus_through_the_pushgateway(stack_env: dict[str, str]) -> None:
    run_id = f"manual__{time.time_ns()}"
    figures = {"llm_pipeline_run_success": 1.0, "llm_pipeline_train_tokens_per_second": 4321.0}
    assert metrics.push({"dag_id": "llm_retrain", "run_id": run_id}, figures, report.FIGURE_HELP)
    deadline = time.monotonic() + 60  # the next scrape (every 5 s)
    while True:
        result = prometheus_query(f'llm_pipeline_train_tokens_per_second{{run_id="{run_id}"}}',
                                  stack_env)["data"]["result"]
        if result or time.monotonic() > deadline:
            break
        time.sleep(1)
    assert result, "the pushed figure never reached Prometheus"
    assert result[0]["metric"]["dag_id"] == "llm_retrain" and result[0]["metric"]["job"] == "llm_pipeline"
    assert float(result[0]["value"][1]) == 4321.0
    # the alert rules are loaded and evaluated
    request = urllib.request.Request(f"{stack_env['PROMETHEUS_URL']}/api/v1/rules", headers=prometheus_login(stack_env))
    with urllib.request.urlopen(request, timeout=10) as resp:
        groups = json.loads(resp.read())["data"]["groups"]
    assert {rule["name"] for g in groups for rule in g["rules"]} >= {"LLMPipelineRunFailed", "LLMCanaryRolledBack"}


def prometheus_login(env: dict[str, str]) -> dict[str, str]:
    return metrics.basic_auth(env["PROMETHEUS_USERNAME"], env["PROMETHEUS_PASSWORD"])


def http_status(url: str, method: str = "GET", data: bytes | None = None, headers: dict[str, str] | None = None) -> int:
    try:
        with urllib.request.urlopen(urllib.request.Request(url, data=data, method=method, headers=headers or {}),
                                    timeout=10) as resp:
            return int(resp.status)
    except urllib.error.HTTPError as exc:
        return exc.code


@pytest.mark.integration
def test_prometheus_and_the_pushgateway_ask_for_their_logins(stack_env: dict[str, str]) -> None:
    """Without its login nobody reads Prometheus (queries, health) nor pushes to the Pushgateway
    (a push could raise or silence an alert); a push with a wrong password is refused, logged and
    reaches no series; Prometheus scrapes itself and the Pushgateway with their logins."""
    prometheus, gateway = stack_env["PROMETHEUS_URL"], stack_env["PUSHGATEWAY_URL"]
    query = f"{prometheus}/api/v1/query?{urllib.parse.urlencode({'query': 'up'})}"
    assert http_status(query) == 401 and http_status(f"{prometheus}/-/ready") == 401
    assert http_status(query, headers=metrics.basic_auth("admin", "wrong")) == 401
    assert http_status(query, headers=prometheus_login(stack_env)) == 200
    # the Pushgateway: reading and pushing
    forged = f"{gateway}{metrics.group_path({'dag_id': 'llm_retrain', 'run_id': 'forged'})}"
    assert http_status(forged, "PUT", b"llm_pipeline_run_success 0\n") == 401
    assert http_status(f"{gateway}/metrics") == 401
    wrong = {**stack_env, "PUSHGATEWAY_PASSWORD": "wrong"}
    assert metrics.push({"dag_id": "llm_retrain", "run_id": "forged"}, {"llm_pipeline_run_success": 0.0}, {}, wrong) is False
    # both scrapes (with the logins) are up, and nothing was pushed by the refused attempts
    assert eventually_value(stack_env, 'sum(up{job=~"prometheus|pushgateway"})', 2.0) == 2.0
    request = urllib.request.Request(f"{gateway}/api/v1/metrics", headers=metrics.basic_auth(
        stack_env["PUSHGATEWAY_USERNAME"], stack_env["PUSHGATEWAY_PASSWORD"]))
    with urllib.request.urlopen(request, timeout=10) as resp:
        groups = [group["labels"] for group in json.loads(resp.read())["data"]]
    assert groups and not [g for g in groups if g.get("run_id") == "forged"]


def eventually_value(env: dict[str, str], expr: str, wanted: float, timeout_s: float = 60) -> float | None:
    """The value of a one-series query once it is ``wanted`` (scrapes come every 5 s) or time is up."""
    deadline = time.monotonic() + timeout_s
    while True:
        result = prometheus_query(expr, env)["data"]["result"]
        value = float(result[0]["value"][1]) if result else None
        if value == wanted or time.monotonic() > deadline:
            return value
        time.sleep(1)
