"""What a trained model came from besides its data: the settings, the process layout and the
software and hardware that ran the training (recorded by the train step in the model's
description, ``training``), and how two such records differ (the reasons a replay reads when
its weights are not the registered ones)."""

from __future__ import annotations

import dataclasses
import hashlib
import importlib.metadata
import os
import platform
import subprocess
from pathlib import Path
from typing import Any

from tasks.config import REPO_ROOT, TrainSettings


def git_commit(repo: Path = REPO_ROOT) -> str:
    """The code version: baked into images at build time (PIPELINE_GIT_COMMIT), else read from
    the checkout, with ``-dirty`` when tracked files differ from that commit."""
    if os.environ.get("PIPELINE_GIT_COMMIT"):
        return os.environ["PIPELINE_GIT_COMMIT"]
    try:
        head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=repo, capture_output=True, text=True,
                              check=True).stdout.strip()
        changed = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=repo,
                                 capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return f"{head}-dirty" if changed else head


def installed_packages() -> dict[str, str]:
    """Every distribution of this environment, name -> version: what the runtime lock installed."""
    found: dict[str, str] = {}
    for dist in importlib.metadata.distributions():
        name = (dist.metadata["Name"] or "").lower().replace("_", "-")
        if name:
            found[name] = dist.version
    return dict(sorted(found.items()))


def packages_hash(packages: dict[str, str]) -> str:
    return hashlib.sha256("".join(f"{name}=={version}\n" for name, version in sorted(packages.items())).encode()).hexdigest()


def cpu_model() -> str:
    """The CPU's model name (``/proc/cpuinfo``), else what the platform says."""
    try:
        with open("/proc/cpuinfo") as fh:
            for line in fh:
                if line.startswith("model name"):
                    return line.partition(":")[2].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def accelerator(device: Any) -> str:
    """The GPU's name on CUDA, ``cpu`` otherwise."""
    import torch

    if getattr(device, "type", "cpu") == "cuda":
        return str(torch.cuda.get_device_name(device))
    return "cpu"


def training_record(settings: TrainSettings, world_size: int, device: Any,
                    dataset_index: dict[str, Any] | None = None) -> dict[str, Any]:
    """The ``training`` entry of a model's description: enough to train it again (with the
    dataset's split, which the tokenize step's settings decided)."""
    import torch

    local = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    packages = installed_packages()
    return {
        "settings": json_ready(dataclasses.asdict(settings)),
        "layout": {"world_size": world_size, "procs_per_node": local, "nodes": max(world_size // local, 1)},
        "dataset": {k: (dataset_index or {}).get(k) for k in ("val_fraction", "tokenizer_hash", "dtype")},
        "runtime": {
            "python": platform.python_version(),
            "torch": str(torch.__version__),
            "packages_sha256": packages_hash(packages),
            "packages": packages,
            "cpu": cpu_model(),
            "accelerator": accelerator(device),
        },
    }


def json_ready(value: Any) -> Any:
    """Tuples as lists, as JSON (and params.yaml) write them."""
    if isinstance(value, dict):
        return {key: json_ready(item) for key, item in value.items()}
    if isinstance(value, list | tuple):
        return [json_ready(item) for item in value]
    return value


def differences(recorded: dict[str, Any], replayed: dict[str, Any]) -> list[str]:
    """How the replay's runtime differs from the recorded one, one phrase each (empty: none)."""
    if not recorded:
        return ["nothing recorded of the first training's runtime (registered before training records)"]
    before, now = recorded.get("runtime", {}), replayed.get("runtime", {})
    found = []
    if before.get("packages_sha256") != now.get("packages_sha256"):
        old, new = before.get("packages", {}), now.get("packages", {})
        changed = [f"{name} {old.get(name, '(none)')} -> {new.get(name, '(none)')}"
                   for name in sorted(set(old) | set(new)) if old.get(name) != new.get(name)]
        found.append("packages: " + (", ".join(changed[:8]) + (f" and {len(changed) - 8} more" if len(changed) > 8 else "")
                                     if changed else "a different environment"))
    for key, what in (("cpu", "CPU"), ("accelerator", "accelerator"), ("python", "Python")):
        if before.get(key) != now.get(key):
            found.append(f"{what}: {before.get(key)} -> {now.get(key)}")
    if recorded.get("layout") != replayed.get("layout"):
        found.append(f"layout: {recorded.get('layout')} -> {replayed.get('layout')}")
    return found
