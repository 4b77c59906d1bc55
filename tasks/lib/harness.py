"""Task suites run by EleutherAI's lm-evaluation-harness (lm-eval): the gate's tasks.

A suite is a folder of lm-eval task YAML (``evaluate.suite.tasks_dir``) whose data are local
files named relative to the folder (``dataset_path: json``, ``dataset_kwargs.data_files``):
nothing is downloaded (the Hugging Face hub and datasets run offline). Each model runs in its
Hugging Face form (the folder the export writes, :func:`tasks.lib.hf_checkpoint.write_checkpoint`)
as lm-eval's ``hf`` model, every example logged, so challenger and champion are compared example
by example: a paired bootstrap over the examples says whether the challenger is worse beyond the
noise, where comparing two means would call a chance difference of a few examples a regression.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from tasks.config import SuiteSettings
from tasks.lib.errors import StepError, first_line

OFFLINE = {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}


@dataclass(frozen=True)
class TaskScore:
    """One model's score on one task, and each example's (by lm-eval's document id)."""

    task: str
    metric: str
    score: float
    per_example: dict[int, float]


@dataclass(frozen=True)
class PairedDifference:
    """Mean of (challenger - champion) over the examples both were scored on, and its
    bootstrap interval."""

    mean: float
    low: float
    high: float
    examples: int

    def to_dict(self) -> dict[str, float | int]:
        return {"mean": self.mean, "low": self.low, "high": self.high, "examples": self.examples}


def metric_key(spec: str) -> tuple[str, str]:
    """``acc`` -> (acc, none); ``exact_match,first_word`` -> (exact_match, first_word)."""
    metric, _, filter_name = spec.partition(",")
    return metric, filter_name or "none"


def suite_folder(suite: SuiteSettings) -> Path:
    folder = suite.folder
    if folder is None or not folder.is_dir():
        raise StepError(f"evaluate.suite.tasks_dir {suite.tasks_dir!r}: no such folder")
    return folder


def task_manager(suite: SuiteSettings, scratch: Path) -> Any:
    """lm-eval's index of the suite's tasks alone (its hundreds of built-in ones not indexed),
    every task named in the settings checked to load, its data included: one line otherwise."""
    os.environ.update(OFFLINE)
    os.environ.setdefault("HF_DATASETS_CACHE", str(scratch / "hf-datasets"))  # read at datasets' import
    from lm_eval.tasks import TaskManager, get_task_dict

    folder = suite_folder(suite)
    manager = TaskManager(include_path=str(folder), include_defaults=False)
    for name in suite.tasks:
        if name not in manager.all_tasks:
            raise StepError(f"evaluate.suite.tasks: {name!r} is not a task of {folder} (it has: "
                            f"{', '.join(sorted(manager.all_tasks)) or 'none'})")
        with contextlib.chdir(folder):
            try:
                get_task_dict([name], manager)
            except Exception as exc:  # datasets' and lm-eval's errors share no base class
                raise StepError(f"{folder}: task {name} cannot be loaded ({type(exc).__name__}: "
                                f"{first_line(exc)})") from None
    return manager


@contextlib.contextmanager
def without_environment_record() -> Iterator[None]:
    """lm-eval's ``simple_evaluate`` records the machine in its results (torch's collect_env runs
    ``pip list``, ``nvidia-smi``, ``lscpu``... as subprocesses: 1.3-2.6 s a model here, twice an
    evaluation), and has no switch for it; the gate reads none of it (the registered version's
    own training record says what ran it). Its one call is left out while a suite runs."""
    from lm_eval import evaluator

    recorded = evaluator.add_env_info
    evaluator.add_env_info = lambda results: None
    try:
        yield
    finally:
        evaluator.add_env_info = recorded


def run_suite(model_folder: Path, add_bos: bool, suite: SuiteSettings, manager: Any) -> dict[str, TaskScore]:
    """Each task's score of the Hugging Face model in ``model_folder`` (greedy, seeded: the same
    model scores the same)."""
    import lm_eval
    import torch

    names = list(suite.tasks)
    # the tasks' data files are named relative to the suite's folder
    with contextlib.chdir(suite_folder(suite)), without_environment_record():
        try:
            results = lm_eval.simple_evaluate(
                model="hf", model_args={"pretrained": str(model_folder), "dtype": "float32",
                                        "device": "cuda" if torch.cuda.is_available() else "cpu",
                                        "add_bos_token": add_bos},
                tasks=names, task_manager=manager, batch_size=suite.batch_size, limit=suite.limit or None,
                log_samples=True, random_seed=0, numpy_random_seed=0, torch_random_seed=0, fewshot_random_seed=0)
        except Exception as exc:  # lm-eval's and transformers' errors share no base class
            raise StepError(f"the task suite failed on {model_folder.parent.name} ({type(exc).__name__}: "
                            f"{first_line(exc)})") from None
    return {name: task_score(name, gate.metric, results) for name, gate in suite.tasks.items()}


def task_score(task: str, spec: str, results: dict[str, Any]) -> TaskScore:
    metric, filter_name = metric_key(spec)
    reported = results["results"].get(task, {})
    score = reported.get(f"{metric},{filter_name}")
    if not isinstance(score, int | float):
        names = sorted(k for k in reported if "," in k and "_stderr" not in k)
        raise StepError(f"evaluate.suite.tasks.{task}.metric {spec!r}: the task reports {', '.join(names) or 'none'}")
    samples = [s for s in results["samples"][task] if s.get("filter", "none") == filter_name and metric in s]
    if not all(isinstance(s[metric], int | float) for s in samples):  # bleu, perplexities: scored over the corpus
        raise StepError(f"evaluate.suite.tasks.{task}.metric {spec!r}: not scored per example (a corpus-level "
                        "metric): the gate compares tasks example by example")
    return TaskScore(task, spec, float(score), {int(s["doc_id"]): float(s[metric]) for s in samples})


def paired_difference(challenger: dict[int, float], champion: dict[int, float], samples: int, confidence: float,
                      seed: int = 0) -> PairedDifference | None:
    """The bootstrap interval of the mean of (challenger - champion) over the examples both
    were scored on, resampled together (seeded: the same scores, the same interval); None when
    they share none."""
    shared = sorted(set(challenger) & set(champion))
    if not shared:
        return None
    differences = np.array([challenger[i] - champion[i] for i in shared])
    rng = np.random.default_rng(seed)
    means = np.concatenate([differences[rng.integers(0, len(shared), size=(chunk, len(shared)))].mean(axis=1)
                            for chunk in chunks(samples, max(1, 2_000_000 // len(shared)))])
    tail = (1 - confidence) / 2
    low, high = np.quantile(means, [tail, 1 - tail])
    return PairedDifference(float(differences.mean()), float(low), float(high), len(shared))


def chunks(total: int, size: int) -> list[int]:
    """``total`` split in parts of at most ``size`` (resamples drawn a part at a time: bounded memory)."""
    return [min(size, total - start) for start in range(0, total, size)]
