"""The ``evaluate`` section: the held-out text, the gate and its limits, the lm-eval task suite."""

from __future__ import annotations

import dataclasses
from pathlib import Path

from tasks.config.base import REPO_ROOT, at_least_zero, check, fractions, positive


@dataclasses.dataclass(frozen=True)
class GateLimits:
    max_eval_perplexity: float
    """The highest ``max_eval_perplexity`` a run may set (its Param's maximum)."""
    min_eval_accuracy: float
    """The lowest ``min_eval_accuracy`` a run may set (its Param's minimum)."""
    max_regression: float
    """The largest ``max_regression`` a run may set (its Param's maximum)."""


@dataclasses.dataclass(frozen=True)
class TaskGate:
    metric: str
    """The lm-eval metric judged, as its results name it: ``acc``, or ``exact_match,first_word`` (metric,filter)."""
    min: float = 0.0
    """Lowest score accepted."""


@dataclasses.dataclass(frozen=True)
class SuiteSettings:
    tasks_dir: str
    """A folder of lm-eval task YAML whose data files are named relative to it (relative: to the repository); empty: no suite."""
    tasks: dict[str, TaskGate]
    """The tasks run, by lm-eval task name, each with its metric and lowest score."""
    max_drop: float
    """The challenger fails a task when its paired bootstrap interval of (challenger - champion) lies wholly below -max_drop."""
    confidence: float
    """Of that interval."""
    bootstrap_samples: int
    """Resamples of the examples."""
    limit: int
    """Examples per task (0: all of them)."""
    batch_size: int
    """lm-eval's batch size."""

    def __post_init__(self) -> None:
        positive(self, "bootstrap_samples", "batch_size")
        at_least_zero(self, "max_drop", "limit")
        check(0.5 <= self.confidence < 1, "confidence", self.confidence, "expected a level in [0.5, 1)")
        check(not self.tasks_dir or bool(self.tasks), "tasks", self.tasks, "expected at least one task (or no tasks_dir)")

    @property
    def folder(self) -> Path | None:
        if not self.tasks_dir:
            return None
        path = Path(self.tasks_dir)
        return path if path.is_absolute() else REPO_ROOT / path


@dataclasses.dataclass(frozen=True)
class EvaluateSettings:
    eval_set_uri: str
    """The fixed evaluation text (held out by the seed, written once)."""
    max_eval_tokens: int
    """Per stream, in windows of the model's seq_len."""
    batch: int
    """Windows per forward."""
    max_eval_perplexity: float
    """Gate: highest perplexity accepted."""
    min_eval_accuracy: float
    """Gate: lowest next-token accuracy accepted."""
    max_regression: float
    """Gate: largest relative perplexity increase over the champion."""
    limits: GateLimits
    """The loosest gate a run may ask for: its Params (and the step's ``--set``) may tighten the gate, never loosen it past these."""
    sample_tokens: int
    """Greedy tokens generated per prompt for the report."""
    prompts: tuple[str, ...]
    """The report's and export's reference prompts."""
    suite: SuiteSettings
    """Task suites run by lm-evaluation-harness on each model's Hugging Face form."""

    def __post_init__(self) -> None:
        positive(self, "max_eval_tokens", "batch", "max_eval_perplexity", "sample_tokens")
        fractions(self, "min_eval_accuracy")
        at_least_zero(self, "max_regression")
        check(bool(self.prompts), "prompts", self.prompts, "expected at least one prompt")
        # the bounds a run sets (the DAG's Params) are checked here, in the step, as well as by the
        # trigger form: a run created before the limits were tightened is refused too
        limits = self.limits
        for name, looser in (("max_eval_perplexity", self.max_eval_perplexity > limits.max_eval_perplexity),
                             ("min_eval_accuracy", self.min_eval_accuracy < limits.min_eval_accuracy),
                             ("max_regression", self.max_regression > limits.max_regression)):
            check(not looser, name, getattr(self, name), f"looser than limits.{name} ({getattr(limits, name):g}): "
                   "a run may tighten the gate, never loosen it")
