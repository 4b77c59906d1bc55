"""Offline checks of what cannot be built or run here (no Docker engine): the Dockerfiles copy
files that exist and install the locked environments; docker-compose.yaml parses under the
Compose Specification, its services reference what exists, and its ports, endpoints and
Prometheus config agree with params.yaml and the local stack."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import yaml
from helpers import REPO_ROOT

from tasks.config import load
from tasks.lib import metrics


def copied_sources(dockerfile: str) -> list[str]:
    """The build-context paths of every COPY (not those copied from another stage)."""
    sources = []
    for line in re.findall(r"^COPY (.+)$", dockerfile, flags=re.M):
        tokens = line.split()
        if any(t.startswith("--from=") for t in tokens):
            continue
        sources += [t for t in tokens if not t.startswith("--")][:-1]
    return sources


def test_dockerfiles_copy_existing_paths_and_use_the_locks() -> None:
    for dockerfile in sorted((REPO_ROOT / "containers").glob("Dockerfile.*")):
        text = dockerfile.read_text()
        for src in copied_sources(text):
            assert (REPO_ROOT / src).exists(), f"{dockerfile.name}: COPY {src} does not exist"
        assert re.search(r"requirements/(runtime|orchestrator)\.txt", text), dockerfile.name
    runtime = (REPO_ROOT / "containers" / "Dockerfile.runtime").read_text()
    assert "USER 1000" in runtime  # the pods' securityContext runs as uid 1000, non-root
    # an image has no .git: the commit its models are tagged with is baked in at build time
    assert "ARG GIT_COMMIT" in runtime and "ENV PIPELINE_GIT_COMMIT=${GIT_COMMIT}" in runtime
    assert copied_sources("COPY --chown=a:b x y /z/\nCOPY --from=runtime /opt/venv /opt/venv\n") == ["x", "y"]


def test_image_kinds_in_params_have_a_dockerfile() -> None:
    settings = load()
    images = settings.launcher.kubernetes.images
    assert set(images) == {"cpu", "gpu"}
    assert all(image.split("@")[0].endswith(f"runtime-{kind}:0.1.0") for kind, image in images.items())
    # the Triton pods run the serving image: the stock one lacks what llm_generate imports
    assert settings.serve.kubernetes.image.split("@")[0].endswith("/serving:0.1.0")
    assert (REPO_ROOT / "containers" / "Dockerfile.serving").exists()


def test_dockerfiles_pass_hadolint() -> None:
    """Every Dockerfile, at hadolint's strictest threshold (each ignored rule says why inline)."""
    hadolint = Path(sys.executable).parent / "hadolint"
    for dockerfile in sorted((REPO_ROOT / "containers").glob("Dockerfile.*")):
        proc = subprocess.run([str(hadolint), "--no-color", "--failure-threshold", "info", str(dockerfile)],
                              capture_output=True, text=True)
        assert proc.returncode == 0, proc.stdout + proc.stderr
    bad = "FROM python:3.11-slim\nRUN apt-get update && apt-get install -y git\n"
    proc = subprocess.run([str(hadolint), "--no-color", "-"], input=bad, capture_output=True, text=True)
    assert proc.returncode != 0 and "DL3008" in proc.stdout  # the check is real


def test_serving_image_installs_what_the_python_backend_models_import() -> None:
    """In a cluster `llm` runs on Triton's own ONNX Runtime (or TensorRT) backend and only
    `llm_generate` on the python backend; the compose stack serves the local variant, `llm` on
    the python backend too: their imports beyond Triton's come from the runtime lock (on GPUs
    ONNX Runtime's CUDA build and torch, tests/tasks/test_engine.py's GPU test)."""
    imported: set[str] = set()
    siblings = {"serving_contract"}  # a model's own modules beside its model.py (the engine, chat, the contract)
    for source in sorted((REPO_ROOT / "tasks" / "serving" / "triton_models").glob("*/*.py")):
        siblings.add(source.stem)
        imported |= set(re.findall(r"^\s*(?:import|from) (\w+)", source.read_text(), flags=re.M))
    # in the repo, not the image: the contract's own module (the image has serving_contract); torch
    # on GPUs only, from the CUDA build's line checked below
    provided = set(sys.stdlib_module_names) | siblings | {"__future__", "triton_python_backend_utils", "tasks",
                                                          "torch"}
    serving = (REPO_ROOT / "containers" / "Dockerfile.serving").read_text()
    installed = set(re.search(r'-c /tmp/runtime.txt ([\w ]+)"\$engine"', serving).group(1).split())  # type: ignore[union-attr]
    # the engine's ONNX Runtime by device: the CUDA build (the same module) with the lock's torch
    # in its CUDA build, in which the engine keeps a GPU's KV cache (imported there only), or the
    # CPU build; docker-compose.yaml's Triton (on the CPU) builds the latter
    assert re.search(r"echo onnxruntime-gpu \|\| echo onnxruntime\)", serving)
    assert "torch==\\1+cu130" in serving and "download.pytorch.org/whl/cu130" in serving
    assert imported - provided == installed | {"onnxruntime"} == {"jinja2", "numpy", "onnxruntime", "tokenizers"}
    assert "ARG DEVICE=gpu" in serving and "USER 1000" in serving
    assert load_compose()["services"]["triton"]["build"]["args"] == {"DEVICE": "cpu"}


def load_compose() -> dict[str, Any]:
    """docker-compose.yaml with its YAML merge keys resolved, as Compose reads it."""
    loaded: dict[str, Any] = yaml.safe_load((REPO_ROOT / "docker-compose.yaml").read_text())
    return loaded


COMPOSE_SERVICES = {"postgres", "seaweedfs", "mlflow", "airflow-init", "airflow-apiserver", "airflow-scheduler",
                    "airflow-dag-processor", "airflow-triggerer", "triton", "openai-api", "router", "pushgateway", "statsd-exporter",
                    "prometheus", "grafana", "serving-reconcile", "mlflow-users", "metrics-auth", "s3-identities"}
ONE_SHOT = {"airflow-init", "serving-reconcile", "mlflow-users", "metrics-auth", "s3-identities"}

# Compose's interpolation: $$, ${NAME}, ${NAME:-default}, ${NAME-default}, ${NAME:?error}, ${NAME?error}
INTERPOLATION = re.compile(r"\$\$|\$\{(?P<name>\w+)(?:(?P<op>:?[-?])(?P<arg>[^}]*))?\}")


class UnsetVariable(ValueError):
    """A ``${NAME:?error}`` whose variable is not set: Compose stops with the error."""


def interpolated(text: str, env: dict[str, str]) -> str:
    """``text`` as Compose interpolates it from ``env``."""
    def value(match: re.Match[str]) -> str:
        if match.group(0) == "$$":
            return "$"
        name, op, arg = match.group("name", "op", "arg")
        unset = env.get(name) is None or (op is not None and op.startswith(":") and env.get(name) == "")
        if unset and op in (":?", "?"):
            raise UnsetVariable(f"{name}: {arg}")
        return arg if unset and op in (":-", "-") else env.get(name, "")

    return INTERPOLATION.sub(value, text)


def compose_variables() -> set[str]:
    """Every variable docker-compose.yaml interpolates."""
    return {m.group("name") for m in INTERPOLATION.finditer((REPO_ROOT / "docker-compose.yaml").read_text())
            if m.group("name")}


def rendered_compose(env: dict[str, str]) -> dict[str, Any]:
    """docker-compose.yaml as `docker compose config` renders it from ``env`` (its variables
    interpolated, its YAML merge keys resolved)."""
    def render(node: Any) -> Any:
        if isinstance(node, dict):
            return {key: render(value) for key, value in node.items()}
        if isinstance(node, list):
            return [render(value) for value in node]
        return interpolated(node, env) if isinstance(node, str) else node

    return render(load_compose())  # type: ignore[no-any-return]


def test_compose_file_parses_under_the_compose_specification() -> None:
    from compose_spec import PyCompose

    compose = PyCompose.from_json(json.dumps(load_compose()))
    compose.validate()
    assert set(compose.service_names()) == COMPOSE_SERVICES
    with pytest.raises(ValueError, match="portz"):  # the parser is strict: the check is real
        PyCompose.from_json(json.dumps({"services": {"a": {"image": "x", "portz": ["80:80"]}}}))


def test_compose_services_reference_what_exists() -> None:
    compose = load_compose()
    services, volumes = compose["services"], set(compose["volumes"])
    for name, service in services.items():
        for needed, condition in ((k, v["condition"]) for k, v in service.get("depends_on", {}).items()):
            assert needed in services, (name, needed)
            if condition == "service_healthy":
                assert "healthcheck" in services[needed], f"{name} waits for {needed}, which has no healthcheck"
            else:
                assert condition == "service_completed_successfully" and needed in ONE_SHOT, (name, needed)
        for key in ("pid", "network_mode"):
            if str(service.get(key, "")).startswith("service:"):
                assert service[key].split(":", 1)[1] in services, (name, key)
        for mount in service.get("volumes", []):
            source = mount.split(":", 1)[0]
            if source.startswith("./"):
                assert (REPO_ROOT / source).exists(), (name, mount)
            else:
                assert source in volumes, (name, mount)
        if "build" in service:
            dockerfile = (REPO_ROOT / service["build"]["dockerfile"]).read_text()
            if "target" in service["build"]:
                assert re.search(rf"^FROM \S+ AS {service['build']['target']}$", dockerfile, flags=re.M), name
        assert name in ONE_SHOT or "healthcheck" in service, f"{name} has no healthcheck"
    # deploy signals the router's nginx from the scheduler: same PID namespace, same user
    scheduler, router = services["airflow-scheduler"], services["router"]
    assert scheduler["pid"] == "service:router" and scheduler["user"] == router["user"]
    assert "stack:/stack" in scheduler["volumes"] and "stack:/stack" in router["volumes"]


def test_compose_ports_and_endpoints_follow_params(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """Every server publishes its params.yaml port on loopback only; the steps get every endpoint
    the local stack gives them (client_env), each naming the service and port that serves it."""
    monkeypatch.setenv("STACK_DIR", str(tmp_path))
    from stack.credentials import PEOPLE_ONLY, client_env

    ports = load().stack.ports
    services = load_compose()["services"]
    published = {
        "seaweedfs": ["s3"], "mlflow": ["mlflow"], "airflow-apiserver": ["airflow"],
        "router": ["router"],  # not Triton: its HTTP port holds repository control
        "pushgateway": ["pushgateway"], "prometheus": ["prometheus"], "grafana": ["grafana"],
    }  # not the StatsD exporter: only Prometheus reads it
    for name, service in services.items():
        expected = [f"127.0.0.1:{ports[p]}:{ports[p]}" for p in published.get(name, [])]
        assert service.get("ports", []) == expected, name
    triton = " ".join(services["triton"]["command"])
    for flag, port in (("http-port", "triton_http"), ("grpc-port", "triton_grpc"), ("metrics-port", "triton_metrics")):
        assert f"--{flag}={ports[port]}" in triton

    env = services["airflow-scheduler"]["environment"]
    assert set(client_env()) - PEOPLE_ONLY <= set(env), set(client_env()) - PEOPLE_ONLY - set(env)
    assert not PEOPLE_ONLY & set(env)  # the steps push figures; reading Prometheus is people's
    serving = {"AWS_ENDPOINT_URL": ("seaweedfs", "s3"), "MLFLOW_TRACKING_URI": ("mlflow", "mlflow"),
               "TRITON_URL": ("triton", "triton_http"), "TRITON_METRICS_URL": ("triton", "triton_metrics"),
               "ROUTER_URL": ("router", "router"), "ROUTER_INTERNAL_URL": ("router", "router_internal"),
               "OPENAI_API_URL": ("openai-api", "openai_api"),
               "PUSHGATEWAY_URL": ("pushgateway", "pushgateway"),
               "PROMETHEUS_URL": ("prometheus", "prometheus")}
    for key, (service, port) in serving.items():
        assert env[key].startswith(f"http://{service}:{ports[port]}"), (key, env[key])
    assert all(env[k].startswith("/stack/") for k in ("TRITON_REPOSITORY", "ROUTER_DIR", "DVC_REGISTRY_DIR"))
    # Airflow's own metrics go to the exporter's StatsD port, with the prefix its mapping matches
    exporter = " ".join(services["statsd-exporter"]["command"])
    assert env["AIRFLOW__METRICS__STATSD_ON"] == "True" and env["AIRFLOW__METRICS__STATSD_HOST"] == "statsd-exporter"
    assert f"--statsd.listen-udp=:{env['AIRFLOW__METRICS__STATSD_PORT']}" in exporter
    assert f"--web.listen-address=:{ports['statsd_exporter']}" in exporter
    mapping = yaml.safe_load((REPO_ROOT / "observability" / "statsd-mapping.yml").read_text())
    assert all(rule["match"].startswith(env["AIRFLOW__METRICS__STATSD_PREFIX"] + ".") for rule in mapping["mappings"])


def test_compose_mlflow_asks_for_logins_and_only_it_holds_the_admin_password() -> None:
    """The mlflow service runs MLflow's basic-auth app on the settings the local stack renders (the
    committed file, no secret in it); the admin's password reaches MLflow and the one-shot that
    creates the pipeline's user, never the steps (the scheduler runs them)."""
    import configparser

    from stack.mlflow_server import mlflow_auth_config

    services = load_compose()["services"]
    mlflow = services["mlflow"]
    assert mlflow["command"][:3] == ["server", "--app-name", "basic-auth"]
    assert "./containers/mlflow-basic-auth.ini:/etc/mlflow/basic_auth.ini:ro" in mlflow["volumes"]
    assert mlflow["environment"]["MLFLOW_AUTH_CONFIG_PATH"] == "/etc/mlflow/basic_auth.ini"
    committed, rendered = configparser.ConfigParser(), configparser.ConfigParser()
    committed.read(REPO_ROOT / "containers" / "mlflow-basic-auth.ini")
    rendered.read_string(mlflow_auth_config("sqlite:////mlflow/basic_auth.db"))
    assert dict(committed["mlflow"]) == dict(rendered["mlflow"]) and "admin_password" not in committed["mlflow"]
    holders = {name for name, service in services.items()
               if any("MLFLOW_ADMIN_PASSWORD" in str(value) for value in (service.get("environment") or {}).values())}
    assert holders == {"mlflow", "mlflow-users"}, holders
    steps = services["airflow-scheduler"]["environment"]
    assert steps["MLFLOW_TRACKING_USERNAME"] == "pipeline" and "MLFLOW_PIPELINE_PASSWORD" in steps["MLFLOW_TRACKING_PASSWORD"]


def test_compose_prometheus_is_the_local_config_by_service_name(tmp_path: Path) -> None:
    from stack.prometheus import prometheus_config, write_metrics_auth

    ports = load().stack.ports
    committed = yaml.safe_load((REPO_ROOT / "observability" / "prometheus-compose.yml").read_text())
    targets = {"prometheus": f"127.0.0.1:{ports['prometheus']}", "pushgateway": f"pushgateway:{ports['pushgateway']}",
               "triton": f"triton:{ports['triton_metrics']}",
               "statsd_exporter": f"statsd-exporter:{ports['statsd_exporter']}"}
    assert committed == prometheus_config(targets, "/etc/prometheus/alerts.yml", "/etc/prometheus/auth")
    mounts = load_compose()["services"]["prometheus"]["volumes"]
    assert "./observability/alerts.yml:/etc/prometheus/alerts.yml:ro" in mounts
    assert "metrics-auth-prometheus:/etc/prometheus/auth:ro" in mounts
    # the same config, its rule file and logins where promtool can read them
    write_metrics_auth(tmp_path / "auth", tmp_path / "auth", "p1", "p2")
    local = tmp_path / "prometheus.yml"
    local.write_text(yaml.safe_dump(prometheus_config(targets, str(REPO_ROOT / "observability" / "alerts.yml"),
                                                      str(tmp_path / "auth"))))
    proc = subprocess.run(["promtool", "check", "config", str(local)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_grafana_is_provisioned_with_prometheus_and_the_dashboard() -> None:
    ports = load().stack.ports
    grafana = load_compose()["services"]["grafana"]
    provisioning = REPO_ROOT / "observability" / "grafana" / "provisioning"
    (source,) = yaml.safe_load((provisioning / "datasources" / "prometheus.yaml").read_text())["datasources"]
    assert source["type"] == "prometheus" and source["url"] == f"http://prometheus:{ports['prometheus']}"
    # Prometheus asks for a login: Grafana's data source has it, and Grafana itself asks for one
    # (an anonymous viewer would read Prometheus through it)
    from stack.credentials import PROMETHEUS_USER

    assert source["basicAuth"] is True and source["basicAuthUser"] == PROMETHEUS_USER
    assert source["secureJsonData"]["basicAuthPassword"] == "$PROMETHEUS_PASSWORD"
    assert "PROMETHEUS_PASSWORD" in grafana["environment"]["PROMETHEUS_PASSWORD"]
    assert grafana["environment"]["GF_AUTH_ANONYMOUS_ENABLED"] == "false"
    assert "GRAFANA_ADMIN_PASSWORD" in grafana["environment"]["GF_SECURITY_ADMIN_PASSWORD"]
    (provider,) = yaml.safe_load((provisioning / "dashboards" / "llm-pipeline.yaml").read_text())["providers"]
    dashboard_mount = next(m for m in grafana["volumes"] if "grafana-dashboard.json" in m)
    assert Path(dashboard_mount.split(":")[1]).parent == Path(provider["options"]["path"])
    assert "./observability/grafana/provisioning:/etc/grafana/provisioning:ro" in grafana["volumes"]


def test_compose_metrics_logins_are_written_by_a_one_shot_the_servers_read(tmp_path: Path) -> None:
    """docker-compose.yaml's metrics-auth writes what Prometheus and the Pushgateway read (their web
    configs, the passwords Prometheus scrapes with), readable by the user their images run as; a
    real Pushgateway on that config refuses anonymous and wrong logins and takes the right one.
    Only the services that need a password get it."""
    from stack.credentials import PUSHGATEWAY_USER
    from stack.prometheus import PROMETHEUS_PASSWORD_FILE, PROMETHEUS_WEB, PUSHGATEWAY_PASSWORD_FILE, PUSHGATEWAY_WEB

    services = load_compose()["services"]
    one_shot = services["metrics-auth"]
    assert one_shot["entrypoint"][-2:] == ["metrics-auth", "/metrics-auth"]
    # a volume per server, each mounted by its server alone: the Pushgateway never holds Prometheus' password
    assert sorted(one_shot["volumes"]) == ["metrics-auth-prometheus:/metrics-auth/prometheus",
                                           "metrics-auth-pushgateway:/metrics-auth/pushgateway"]
    for volume in ("metrics-auth-prometheus", "metrics-auth-pushgateway"):
        mounted_by = {name for name, service in services.items()
                      if any(str(m).startswith(f"{volume}:") for m in service.get("volumes", []))}
        assert mounted_by == {"metrics-auth", volume.removeprefix("metrics-auth-")}, (volume, mounted_by)
    assert f"--web.config.file=/etc/pushgateway/auth/{PUSHGATEWAY_WEB}" in services["pushgateway"]["command"]
    # each run's figures kept across restarts, on a volume where the image's user may write
    assert "--persistence.file=/pushgateway/metrics.data" in services["pushgateway"]["command"]
    assert "pushgateway:/pushgateway" in services["pushgateway"]["volumes"]
    assert f"--web.config.file=/etc/prometheus/auth/{PROMETHEUS_WEB}" in services["prometheus"]["command"]
    assert PUSHGATEWAY_PASSWORD_FILE in services["pushgateway"]["healthcheck"]["test"][1]
    assert PROMETHEUS_PASSWORD_FILE in services["prometheus"]["healthcheck"]["test"][1]
    holders = {variable: {name for name, service in services.items()
                          if any(variable in str(value) for value in (service.get("environment") or {}).values())}
               for variable in ("PROMETHEUS_PASSWORD", "PUSHGATEWAY_PASSWORD")}
    assert holders["PROMETHEUS_PASSWORD"] == {"metrics-auth", "grafana"}, holders
    assert "metrics-auth" in holders["PUSHGATEWAY_PASSWORD"] and "airflow-scheduler" in holders["PUSHGATEWAY_PASSWORD"]
    assert not holders["PUSHGATEWAY_PASSWORD"] & {"triton", "router", "openai-api", "mlflow", "grafana"}

    out = tmp_path / "auth"
    run = [sys.executable, "-m", "stack", "metrics-auth", str(out)]
    missing = subprocess.run(run, cwd=REPO_ROOT, capture_output=True, text=True, env={"PATH": "/usr/bin:/bin"})
    assert missing.returncode == 2 and missing.stderr.count("\n") == 1 and "PROMETHEUS_PASSWORD" in missing.stderr
    assert not out.exists()  # nothing half-written
    written = subprocess.run(run, cwd=REPO_ROOT, capture_output=True, text=True,
                             env={"PATH": "/usr/bin:/bin", "PROMETHEUS_PASSWORD": "prom-pw", "PUSHGATEWAY_PASSWORD": "push-pw"})
    assert written.returncode == 0, written.stderr
    modes = {str(p.relative_to(out)): p.stat().st_mode & 0o777 for p in out.rglob("*") if p.is_file()}
    assert modes == {f"prometheus/{PROMETHEUS_WEB}": 0o644, f"prometheus/{PROMETHEUS_PASSWORD_FILE}": 0o644,
                     f"prometheus/{PUSHGATEWAY_PASSWORD_FILE}": 0o644, f"pushgateway/{PUSHGATEWAY_WEB}": 0o644,
                     f"pushgateway/{PUSHGATEWAY_PASSWORD_FILE}": 0o644}
    for web in (f"prometheus/{PROMETHEUS_WEB}", f"pushgateway/{PUSHGATEWAY_WEB}"):
        checked = subprocess.run(["promtool", "check", "web-config", str(out / web)], capture_output=True, text=True)
        assert checked.returncode == 0, checked.stdout + checked.stderr
    assert (out / "pushgateway" / PUSHGATEWAY_PASSWORD_FILE).read_text() == "push-pw"

    import socket
    import urllib.error
    import urllib.request

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    gateway = subprocess.Popen(["prometheus-pushgateway", f"--web.listen-address=127.0.0.1:{port}",
                                f"--web.config.file={out / 'pushgateway' / PUSHGATEWAY_WEB}", "--persistence.file="],
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

    def status(headers: dict[str, str]) -> int | None:
        request = urllib.request.Request(f"http://127.0.0.1:{port}/metrics/job/t", data=b"x 1\n", method="PUT",
                                         headers=headers)
        try:
            with urllib.request.urlopen(request, timeout=5) as resp:
                return int(resp.status)
        except urllib.error.HTTPError as exc:
            return exc.code
        except OSError:
            return None  # not listening yet

    try:
        deadline = time.monotonic() + 20
        while status({}) is None and time.monotonic() < deadline:
            time.sleep(0.2)
        assert status({}) == 401
        assert status(metrics.basic_auth(PUSHGATEWAY_USER, "wrong")) == 401
        assert status(metrics.basic_auth(PUSHGATEWAY_USER, "push-pw")) == 200
    finally:
        gateway.kill()
        gateway.wait()


def test_locks_pin_only_versions_an_index_hosts() -> None:
    """PyPI never hosts local versions (`torch==2.13.0+cpu`): such a pin stops a fresh install."""
    for lock in sorted((REPO_ROOT / "requirements").glob("*.txt")):
        pins = [line for line in lock.read_text().splitlines() if "==" in line and not line.startswith("#")]
        assert pins, lock.name
        local = [pin for pin in pins if "+" in pin.split("==", 1)[1]]
        assert local == [], f"{lock.name}: local versions no index serves: {local}"


def test_torch_comes_from_its_own_index_in_the_makefile_and_the_images() -> None:
    """Both installers (the Makefile for the dev venvs, install-runtime.sh for the images that
    hold the runtime) take the lock's torch pin from TORCH_INDEX_URL alone (no deps, so the
    extra index is asked for one page only) and the rest of the lock from the default index.
    The Makefile installs torch so twice: the runtime venv, and vLLM's (the serving benchmark)."""
    makefile = (REPO_ROOT / "Makefile").read_text()
    script = (REPO_ROOT / "containers" / "install-runtime.sh").read_text()
    for name, text, venvs in (("Makefile", makefile, 2), ("install-runtime.sh", script, 1)):
        torch_install = [line for line in text.splitlines() if "--index-url" in line]
        assert len(torch_install) == venvs, name
        for line in torch_install:
            assert "--no-deps" in line and "TORCH_INDEX_URL" in line and "torch.txt" in line, name
        assert "grep -v '^torch=='" in text, name
        assert "extra-index-url" not in text, name
    assert "TORCH_INDEX_URL ?= https://download.pytorch.org/whl/cpu" in makefile
    for dockerfile in ("Dockerfile.runtime", "Dockerfile.airflow"):
        text = (REPO_ROOT / "containers" / dockerfile).read_text()
        assert "ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu" in text, dockerfile
        assert "/tmp/install-runtime.sh /opt/venv/bin/python /tmp/runtime.txt" in text, dockerfile


def test_first_make_step_names_the_interpreter_to_install(tmp_path: Path) -> None:
    """An unsupported Python stops `make` at once with one line, not a resolver traceback."""
    shutil.copy(REPO_ROOT / "Makefile", tmp_path / "Makefile")
    stamp = ".venvs/.system-deps"
    for python, supported in ((sys.executable, "3.99"), (str(tmp_path / "no-python"), "3.11")):
        proc = subprocess.run(["make", "-s", stamp, f"PYTHON={python}", f"SUPPORTED_PYTHON={supported}"],
                              cwd=tmp_path, capture_output=True, text=True, timeout=60)
        errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
        assert proc.returncode != 0 and len(errors) == 1, proc.stderr
        assert f"needs Python {supported}" in errors[0] and f"PYTHON={python} is" in errors[0]
        assert not (tmp_path / stamp).exists()
    running = ".".join(map(str, sys.version_info[:2]))
    proc = subprocess.run(["make", "-s", stamp, f"PYTHON={sys.executable}", f"SUPPORTED_PYTHON={running}"],
                          cwd=tmp_path, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0 and (tmp_path / stamp).exists(), proc.stderr


def test_the_pipeline_installs_no_test_tool(tmp_path: Path) -> None:
    """`make pipeline` and `make env` install what the pipeline runs; the test tools (the test
    locks, chromium, Node.js and npm, the Gateway API check's packages) come with `make
    test-env` only, which make test, test-fast and lint run first. Read from make's own plan
    (`make -n --always-make`: every command it would run), and the locks the images install hold
    no test tool."""
    shutil.copy(REPO_ROOT / "Makefile", tmp_path / "Makefile")
    for lock in ("runtime", "orchestrator", "runtime-test", "orchestrator-test"):
        (tmp_path / "requirements").mkdir(exist_ok=True)
        (tmp_path / "requirements" / f"{lock}.txt").touch()
    (tmp_path / "tests/plugins/gateway_api").mkdir(parents=True)
    (tmp_path / "tests/plugins/gateway_api/package-lock.json").touch()

    def planned(target: str) -> str:
        proc = subprocess.run(["make", "-n", "--always-make", target], cwd=tmp_path, capture_output=True, text=True,
                              timeout=60)
        assert proc.returncode == 0, proc.stderr
        return proc.stdout

    test_tools = re.compile(r"chromium|\bnpm\b|nodejs|-test\.txt|playwright")
    # pipeline's own recipe calls make (make -n runs that line): its prerequisites are planned
    pipeline = re.search(r"^pipeline: (.*)$", (REPO_ROOT / "Makefile").read_text(), flags=re.M).group(1).split()  # type: ignore[union-attr]
    for target in ("env", *pipeline):
        assert not test_tools.findall(planned(target)), target
    for target in ("test-env", "test-fast", "lint"):
        assert set(test_tools.findall(planned(target))) >= {"chromium", "npm", "nodejs", "-test.txt"}, target
    tools = {"pytest", "hypothesis", "schemathesis", "playwright", "mypy", "ruff", "kubernetes-validate"}
    for lock in ("runtime", "orchestrator"):
        pinned = {line.split("==")[0].lower() for line in (REPO_ROOT / "requirements" / f"{lock}.txt").read_text().splitlines()
                  if "==" in line}
        assert not pinned & tools, (lock, pinned & tools)


def test_compose_openai_api_writes_its_capture_with_its_own_key_only(tmp_path: Path) -> None:
    """The OpenAI front (the process clients reach) gets the S3 endpoint and the capture's key,
    never the pipeline's (which can replace the exports Triton runs); SeaweedFS reads both
    identities from s3-identities' file, the local stack's (s3_identities: the capture's key may
    only write under serve.capture.uri, tests/stack), and no key from its environment."""
    from stack.seaweedfs import s3_identities

    env = {name: f"value-of-{name}" for name in compose_variables()}  # each variable told apart by its value
    services = rendered_compose(env)["services"]
    s3_port = load().stack.ports["s3"]
    assert services["openai-api"]["environment"] == {
        "AWS_ENDPOINT_URL": f"http://seaweedfs:{s3_port}", "AWS_DEFAULT_REGION": "us-east-1",
        "AWS_ACCESS_KEY_ID": env["CAPTURE_AWS_ACCESS_KEY_ID"],
        "AWS_SECRET_ACCESS_KEY": env["CAPTURE_AWS_SECRET_ACCESS_KEY"], "CAPTURE_CLIENT_KEY": env["CAPTURE_CLIENT_KEY"]}

    def holders(value: str) -> set[str]:
        return {name for name, service in services.items() if value in json.dumps(service)}

    assert holders(env["CAPTURE_AWS_SECRET_ACCESS_KEY"]) == {"openai-api", "s3-identities"}
    pipeline_key = holders(env["AWS_SECRET_ACCESS_KEY"])
    assert {"s3-identities", "mlflow", "airflow-scheduler"} <= pipeline_key  # MLflow's artifacts, the steps
    assert not pipeline_key & {"openai-api", "triton", "router", "seaweedfs", "prometheus", "grafana"}, pipeline_key
    assert "environment" not in services["seaweedfs"]  # with AWS_* it would adopt them as an admin identity
    with pytest.raises(UnsetVariable, match="CAPTURE_AWS_ACCESS_KEY_ID: export the OpenAI front's S3 key"):
        rendered_compose({k: v for k, v in env.items() if k != "CAPTURE_AWS_ACCESS_KEY_ID"})

    # SeaweedFS reads the one-shot's file, on a volume no other service mounts
    one_shot, seaweedfs = services["s3-identities"], services["seaweedfs"]
    folder = one_shot["entrypoint"][-1]
    assert one_shot["entrypoint"][-2:] == ["s3-identities", folder] and one_shot["volumes"] == [f"s3-identities:{folder}"]
    mount = next(m for m in seaweedfs["volumes"] if m.startswith("s3-identities:"))
    assert mount.endswith(":ro") and f"-s3.config={mount.split(':')[1]}/s3.json" in seaweedfs["command"].split()
    assert seaweedfs["depends_on"] == {"s3-identities": {"condition": "service_completed_successfully"}}
    assert {name for name, service in services.items()
            if any(str(m).startswith("s3-identities:") for m in service.get("volumes", []))} == {"s3-identities", "seaweedfs"}

    run = [sys.executable, "-m", "stack", "s3-identities", str(tmp_path / "out")]
    written = subprocess.run(run, cwd=REPO_ROOT, capture_output=True, text=True,
                             env={"PATH": "/usr/bin:/bin", **one_shot["environment"]})
    assert written.returncode == 0, written.stderr
    config = tmp_path / "out" / "s3.json"
    assert config.stat().st_mode & 0o777 == 0o644  # SeaweedFS's image runs as another user than the one-shot
    keys = {identity: {"access_key": env[f"{prefix}AWS_ACCESS_KEY_ID"], "secret_key": env[f"{prefix}AWS_SECRET_ACCESS_KEY"]}
            for identity, prefix in (("pipeline", ""), ("capture", "CAPTURE_"))}
    assert json.loads(config.read_text()) == s3_identities(keys["pipeline"], keys["capture"], load().serve.capture.uri)
    # a missing key, or the capture given the pipeline's: one line, nothing written
    for broken, message in (({"CAPTURE_AWS_SECRET_ACCESS_KEY": ""}, "needs CAPTURE_AWS_SECRET_ACCESS_KEY"),
                            ({"CAPTURE_AWS_ACCESS_KEY_ID": env["AWS_ACCESS_KEY_ID"]}, "give the OpenAI front its own")):
        refused = subprocess.run([*run[:-1], str(tmp_path / "refused")], cwd=REPO_ROOT, capture_output=True, text=True,
                                 env={"PATH": "/usr/bin:/bin", **one_shot["environment"], **broken})
        assert refused.returncode == 2 and refused.stderr.count("\n") == 1 and message in refused.stderr, refused.stderr
        assert not (tmp_path / "refused").exists()


def test_compose_one_shots_write_only_to_folders_their_image_gives_their_user() -> None:
    """A new named volume starts as the image's folder at its mount point (root's, where the
    image has none): a service of the local image running as 50000 can write to its volume only
    if the image made that folder and gave it to 50000."""
    local = (REPO_ROOT / "containers" / "Dockerfile.airflow").read_text().split("AS local", 1)[1]

    def folders(command: str) -> list[Path]:
        return [Path(p) for p in re.search(rf"{command} ([^\n\\&]+)", local).group(1).split()]  # type: ignore[union-attr]

    made, chowned = folders("mkdir -p"), folders("chown -R 50000:0")
    compose = load_compose()
    for name, service in compose["services"].items():
        if service.get("image") != "llm-pipeline/airflow-local:0.1.0" or service.get("user") != "50000:0":
            continue
        for mount in service.get("volumes", []):
            source, target = mount.split(":")[:2]
            if source in compose["volumes"] and not mount.endswith(":ro") and not target.startswith("/opt/airflow/"):
                assert Path(target) in made and any(Path(target).is_relative_to(c) for c in chowned), (name, mount)
