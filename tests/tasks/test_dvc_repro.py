"""dvc.yaml reproduces the data half outside Airflow with the same step commands."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml
from helpers import REPO_ROOT, RUNTIME_PY, SEED_URI

from tasks.config import load


def test_dvc_shard_stages_match_the_shard_count() -> None:
    """DVC cannot compute a range: repro.shards is written out, and must name every shard of
    tokenize.num_shards as the merge step reads them (past 10 shards too)."""
    settings = load(REPO_ROOT / "params.yaml")
    assert settings.repro.shards == tuple(f"{i:05d}" for i in range(settings.tokenize.num_shards))
    stages = yaml.safe_load((REPO_ROOT / "dvc.yaml").read_text())["stages"]
    assert stages["encode"]["do"]["outs"] == ["data/tokenize/shards/${item}"]
    assert "--shard-index ${item}" in stages["encode"]["do"]["cmd"]
    assert "${pipeline.lookback_days}" in stages["snapshot"]["cmd"]  # one look-back setting


@pytest.mark.integration
def test_dvc_repro_runs_the_data_half(seeded_raw: str, tmp_path: Path) -> None:
    # a copy of the checkout, so the run writes data/ and dvc.lock there, not into the repo
    files = subprocess.run(["git", "ls-files", "-co", "--exclude-standard"], cwd=REPO_ROOT,
                           capture_output=True, text=True, check=True).stdout.split()
    for name in files:
        if (REPO_ROOT / name).is_file():
            (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(REPO_ROOT / name, tmp_path / name)
    params = yaml.safe_load((tmp_path / "params.yaml").read_text())
    params["pipeline"]["raw_data_uri"] = SEED_URI
    (tmp_path / "params.yaml").write_text(yaml.safe_dump(params))
    subprocess.run(["git", "init", "-q"], cwd=tmp_path, check=True)

    env_path = f"{RUNTIME_PY.parent}:/usr/bin:/bin"
    proc = subprocess.run([str(RUNTIME_PY), "-m", "dvc", "repro"], cwd=tmp_path, capture_output=True, text=True,
                          env={**os.environ, "PATH": env_path}, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    index = json.loads((tmp_path / "data/tokenize/dataset/index.json").read_text())
    assert index["splits"]["train"]["tokens"] > 100_000
    lock = yaml.safe_load((tmp_path / "dvc.lock").read_text())
    assert {"snapshot", "validate", "tokenizer", "encode@00000", "encode@00001", "merge"} <= set(lock["stages"])
