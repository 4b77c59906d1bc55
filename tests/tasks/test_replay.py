"""The replay's parts that need no server: the weights' comparison, what a training record says
about the runtime, and the recorded settings the train step takes (the whole replay, against the
real stack and Airflow: tests/dags/test_llm_replay.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tasks.lib.errors import StepError
from tasks.lib.provenance import differences, installed_packages, packages_hash, training_record
from tasks.replay import compare_weights


def weights() -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    return {"embed.weight": torch.randn(8, 4, generator=generator), "blocks.0.w": torch.randn(4, 4, generator=generator),
            "norm.weight": torch.ones(4)}


def test_identical_weights_compare_identical() -> None:
    assert compare_weights(weights(), weights()) == {"tensors": 3, "identical": True, "identical_tensors": 3,
                                                     "first_difference": None}


def test_the_first_differing_tensor_is_named_with_its_largest_difference() -> None:
    replayed = weights()
    replayed["blocks.0.w"][1, 2] += 0.5
    replayed["norm.weight"][0] = 2.0  # a second difference, later in the state dict's order
    found = compare_weights(weights(), replayed)
    assert found["identical"] is False and found["identical_tensors"] == 1
    assert found["first_difference"] == {"tensor": "blocks.0.w", "max_abs_diff": pytest.approx(0.5),
                                         "differing_elements": 1, "elements": 16}


def test_other_tensors_or_shapes_are_a_difference_too() -> None:
    other = {**weights(), "blocks.0.w": torch.zeros(4, 5)}
    assert compare_weights(weights(), other)["first_difference"] == {
        "tensor": "blocks.0.w", "reason": "(4, 4) torch.float32 vs (4, 5) torch.float32"}
    fewer = {k: v for k, v in weights().items() if k != "norm.weight"}
    assert compare_weights(weights(), fewer)["first_difference"]["tensor"] == "norm.weight"


def test_a_training_record_names_what_differs_between_two_runtimes() -> None:
    from tasks.lib.params import load_settings

    record = training_record(load_settings().train, world_size=2, device=torch.device("cpu"))
    json.dumps(record)  # it goes into config.json as it is
    assert record["settings"]["betas"] == [0.9, 0.95] and record["settings"]["presets"]["cpu-tiny"]["seq_len"] == 128
    assert record["runtime"]["torch"] == torch.__version__ and record["runtime"]["accelerator"] == "cpu"
    assert record["runtime"]["packages_sha256"] == packages_hash(installed_packages())
    assert differences(record, json.loads(json.dumps(record))) == []

    later = json.loads(json.dumps(record))
    later["runtime"]["packages"]["torch"] = "9.9.9"
    later["runtime"]["packages"]["newpkg"] = "1.0"
    later["runtime"]["packages_sha256"] = packages_hash(later["runtime"]["packages"])
    later["runtime"]["cpu"] = "Another CPU"
    later["layout"] = {**record["layout"], "world_size": 4, "nodes": 4}
    found = differences(record, later)
    assert found[0] == f"packages: newpkg (none) -> 1.0, torch {torch.__version__} -> 9.9.9"
    assert found[1] == f"CPU: {record['runtime']['cpu']} -> Another CPU"
    assert found[2].startswith("layout: {'world_size': 2")


def test_the_train_step_takes_the_recorded_settings_and_refuses_bad_ones(tmp_path: Path) -> None:
    from tasks.lib.params import load_settings
    from tasks.train.__main__ import recorded_settings

    record = training_record(load_settings().train, world_size=1, device=torch.device("cpu"))["settings"]
    path = tmp_path / "settings.json"
    path.write_text(json.dumps({**record, "max_steps": 7}))
    settings = recorded_settings(str(path), ["lr=0.01"])
    assert settings.max_steps == 7 and settings.lr == 0.01 and settings.betas == (0.9, 0.95)
    path.write_text(json.dumps({**record, "engine": "horovod"}))
    with pytest.raises(StepError, match=rf"--settings {path}: train.engine 'horovod': expected one of fsdp2"):
        recorded_settings(str(path), [])
