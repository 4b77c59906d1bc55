"""Offline checks of what cannot be built here (no Docker engine): the Dockerfiles copy files
that exist and install the locked environments; docker-compose.yaml is well-formed."""

from __future__ import annotations

import re

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


def test_image_kinds_in_params_have_a_dockerfile() -> None:
    images = load_params()["launcher"]["kubernetes"]["images"]
    assert set(images) == {"cpu", "gpu"}
    assert all(image.endswith(f"runtime-{kind}:0.1.0") for kind, image in images.items())


def test_compose_file_is_well_formed() -> None:
    compose = yaml.safe_load((REPO_ROOT / "docker-compose.yaml").read_text())
    assert set(compose["services"]) == {"seaweedfs", "mlflow"}
    ports = load_params()["stack"]["ports"]
    assert compose["services"]["seaweedfs"]["ports"] == [f"127.0.0.1:{ports['s3']}:{ports['s3']}"]
    assert compose["services"]["mlflow"]["ports"] == [f"127.0.0.1:{ports['mlflow']}:{ports['mlflow']}"]
