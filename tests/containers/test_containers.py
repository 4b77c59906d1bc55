"""Offline checks of what cannot be built here (no Docker engine): the Dockerfiles copy files
that exist and install the locked environments; docker-compose.yaml is well-formed."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import yaml
from helpers import REPO_ROOT

from tasks.lib.params import load_params


def test_dockerfiles_copy_existing_paths_and_use_the_locks() -> None:
    for dockerfile in sorted((REPO_ROOT / "containers").glob("Dockerfile.*")):
        text = dockerfile.read_text()
        for src in re.findall(r"^COPY (?:--chown=\S+ )?(\S+) ", text, flags=re.M):
            assert (REPO_ROOT / src).exists(), f"{dockerfile.name}: COPY {src} does not exist"
        assert re.search(r"requirements/(runtime|orchestrator)\.txt", text), dockerfile.name
    runtime = (REPO_ROOT / "containers" / "Dockerfile.runtime").read_text()
    assert "USER 1000" in runtime  # the pods' securityContext runs as uid 1000, non-root
    # an image has no .git: the commit its models are tagged with is baked in at build time
    assert "ARG GIT_COMMIT" in runtime and "ENV PIPELINE_GIT_COMMIT=${GIT_COMMIT}" in runtime


def test_image_kinds_in_params_have_a_dockerfile() -> None:
    params = load_params()
    images = params["launcher"]["kubernetes"]["images"]
    assert set(images) == {"cpu", "gpu"}
    assert all(image.endswith(f"runtime-{kind}:0.1.0") for kind, image in images.items())
    # the Triton pods run the serving image: the stock one lacks what llm_generate imports
    assert params["serve"]["kubernetes"]["image"].endswith("/serving:0.1.0")
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
    `llm_generate` on the python backend: its imports beyond Triton's come from the runtime lock."""
    model = (REPO_ROOT / "tasks" / "triton_models" / "llm_generate" / "model.py").read_text()
    imported = set(re.findall(r"^(?:import|from) (\w+)", model, flags=re.M))
    provided = {"__future__", "json", "os", "typing", "triton_python_backend_utils"}
    serving = (REPO_ROOT / "containers" / "Dockerfile.serving").read_text()
    installed = set(re.search(r"-c /tmp/runtime.txt ([\w ]+)", serving).group(1).split())  # type: ignore[union-attr]
    assert imported - provided == installed == {"numpy", "tokenizers"}
    assert "USER 1000" in serving


def test_compose_file_is_well_formed() -> None:
    compose = yaml.safe_load((REPO_ROOT / "docker-compose.yaml").read_text())
    assert set(compose["services"]) == {"seaweedfs", "mlflow"}
    ports = load_params()["stack"]["ports"]
    assert compose["services"]["seaweedfs"]["ports"] == [f"127.0.0.1:{ports['s3']}:{ports['s3']}"]
    assert compose["services"]["mlflow"]["ports"] == [f"127.0.0.1:{ports['mlflow']}:{ports['mlflow']}"]


def test_locks_pin_only_versions_an_index_hosts() -> None:
    """PyPI never hosts local versions (`torch==2.13.0+cpu`): such a pin stops a fresh install."""
    for lock in sorted((REPO_ROOT / "requirements").glob("*.txt")):
        pins = [line for line in lock.read_text().splitlines() if "==" in line and not line.startswith("#")]
        assert pins, lock.name
        local = [pin for pin in pins if "+" in pin.split("==", 1)[1]]
        assert local == [], f"{lock.name}: local versions no index serves: {local}"


def test_torch_comes_from_its_own_index_in_the_makefile_and_the_image() -> None:
    """Both installers take the lock's torch pin from TORCH_INDEX_URL alone (no deps, so the
    extra index is asked for one page only) and the rest of the lock from the default index."""
    makefile = (REPO_ROOT / "Makefile").read_text()
    dockerfile = (REPO_ROOT / "containers" / "Dockerfile.runtime").read_text()
    for name, text in (("Makefile", makefile), ("Dockerfile.runtime", dockerfile)):
        torch_install = [line for line in text.splitlines() if "--index-url" in line]
        assert len(torch_install) == 1 and "--no-deps" in torch_install[0], name
        assert "TORCH_INDEX_URL" in torch_install[0] and "torch.txt" in torch_install[0], name
        assert "grep -v '^torch=='" in text, name
        assert "extra-index-url" not in text, name
    assert "TORCH_INDEX_URL ?= https://download.pytorch.org/whl/cpu" in makefile
    assert "ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu" in dockerfile


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
