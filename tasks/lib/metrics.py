"""A run's figures as Prometheus metrics, pushed to a Pushgateway (``PUSHGATEWAY_URL``).

Batch work cannot be scraped while it runs, so the run report pushes what it gathered (verdict,
training throughput and loss, evaluation, the deployed version) once per DAG run, in the
Pushgateway's text format. The group is ``job/llm_pipeline/dag_id/<dag>/run_id/<run>``: runs never
overwrite each other, and Prometheus (``honor_labels``) keeps those labels on every series. A
Pushgateway outage is logged and does not fail the step: monitoring must not undo a finished run.
"""

from __future__ import annotations

import base64
import math
import os
import urllib.error
import urllib.request
from collections.abc import Mapping

from tasks.lib.step import log

JOB = "llm_pipeline"


def exposition(figures: Mapping[str, float | None], help_texts: Mapping[str, str]) -> str:
    """Gauges in Prometheus' text format; None and non-finite figures are left out. A figure's
    key is a series: a name, or a name with labels (``name{label="value"}``; one HELP per name)."""
    lines, described = [], set()
    for series, value in figures.items():
        if value is None or not math.isfinite(float(value)):
            continue
        name = series.split("{", 1)[0]
        if name not in described:
            described.add(name)
            lines += [f"# HELP {name} {help_texts.get(name, name)}", f"# TYPE {name} gauge"]
        lines.append(f"{series} {float(value)!r}")
    return "\n".join(lines) + "\n"


def line_label() -> str:
    """The ``line`` label of what a step pushes: the model line it runs for (``demo``: params.yaml's)."""
    from tasks.config import current_line, line_label

    return line_label(current_line())


def group_path(grouping: Mapping[str, str]) -> str:
    """``/metrics/job/<job>/<label>@base64/<value>...``: base64 (URL alphabet) lets a value hold '/'."""
    parts = [f"/metrics/job/{JOB}"]
    for label, value in grouping.items():
        encoded = base64.urlsafe_b64encode(value.encode()).decode().rstrip("=") or "="
        parts.append(f"/{label}@base64/{encoded}")
    return "".join(parts)


def basic_auth(username: str, password: str) -> dict[str, str]:
    """The ``Authorization`` header of an HTTP basic-auth login (the Pushgateway's, Prometheus',
    MLflow's)."""
    token = base64.b64encode(f"{username}:{password}".encode()).decode()
    return {"Authorization": f"Basic {token}"}


def push(grouping: Mapping[str, str], figures: Mapping[str, float | None], help_texts: Mapping[str, str],
         env: Mapping[str, str] | None = None) -> bool:
    """Replace this group's metrics (HTTP PUT) on the Pushgateway at ``PUSHGATEWAY_URL`` of ``env``
    (default: this process's environment), with its login ``PUSHGATEWAY_USERNAME`` /
    ``PUSHGATEWAY_PASSWORD`` where set; False when not configured, not reachable or refused."""
    env = os.environ if env is None else env
    url = env.get("PUSHGATEWAY_URL", "").rstrip("/")
    if not url:
        return False
    headers = {"Content-Type": "text/plain; version=0.0.4"}
    if env.get("PUSHGATEWAY_USERNAME"):
        headers.update(basic_auth(env["PUSHGATEWAY_USERNAME"], env.get("PUSHGATEWAY_PASSWORD", "")))
    request = urllib.request.Request(url + group_path(grouping), data=exposition(figures, help_texts).encode(),
                                     method="PUT", headers=headers)
    try:
        with urllib.request.urlopen(request, timeout=10):
            return True
    except (urllib.error.URLError, OSError) as exc:
        log.warning("metrics not pushed to %s: %s", url, exc)
        return False
