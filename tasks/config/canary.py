"""The ``canary`` section: the rollout's steps, its analysis and the person approving it."""

from __future__ import annotations

import dataclasses

from tasks.config.base import at_least_zero, check, fractions, positive


@dataclasses.dataclass(frozen=True)
class Approval:
    enabled: bool
    """A person approves the rollout before it goes on: the default of the retrain DAG's approval Param (an Airflow HITL task)."""
    required: bool
    """This deployment requires the approval: a run cannot switch it off (its Param is refused, and a false one reaching deploy is overridden)."""
    approvers: tuple[str, ...]
    """Airflow user ids who may answer (the HITL task's assigned users; the simple auth manager's ids are user names); empty: anyone who may edit the DAG."""
    four_eyes: bool
    """The user who triggered the run may not answer its approval: Airflow refuses them when they are among the approvers, and the task refuses an answer of theirs."""
    hold_before: int | float
    """The rollout holds before the step of this weight (one of steps), at the weight before it (0: after shadow)."""
    timeout_s: float
    """No answer by then: rolled back."""

    def __post_init__(self) -> None:
        positive(self, "hold_before", "timeout_s")
        check(all(name.strip() == name and name for name in self.approvers) and
               len(set(self.approvers)) == len(self.approvers), "approvers", list(self.approvers),
               "expected distinct Airflow user ids, none empty")

    @property
    def active(self) -> bool:
        """Whether a rollout holds for a person: the run asked for it, or this deployment requires it."""
        return self.enabled or self.required


@dataclasses.dataclass(frozen=True)
class CanarySettings:
    shadow: bool
    """Before any weighted step, mirror live /v1 requests to the new version and compare its answers with stable's."""
    shadow_min_stable_agreement: float
    """Share of greedy answers the new version must give exactly as stable does in shadow (0: reported only)."""
    steps: tuple[int | float, ...]
    """Traffic share (%) of the new version at each step (0.1 steps: the routes are per mille); 100 ends the rollout."""
    step_duration_s: float
    """Real traffic through the router at each step ..."""
    rate_rps: float
    """... at this rate (logits requests, prompts from the eval text)."""
    concurrency: int
    """Requests in flight at once."""
    request_timeout_s: float
    """Of one logits request."""
    max_error_rate: float
    """Of the canary's requests."""
    min_agreement: float
    """Canary next tokens equal to the export's parity reference."""
    latency_alpha: float
    """Mann-Whitney U, one-sided: is the canary slower than stable?"""
    max_latency_ratio: float
    """... and its median latency at least this times stable's."""
    min_samples: int
    """Canary requests per step: the window repeats until it has them ..."""
    max_windows: int
    """... at most this many times, else the step fails."""
    text_rps: float
    """Streams a second on the text endpoint (/v1/completions, greedy)."""
    text_min_samples: int
    """Canary streams per step."""
    text_timeout_s: float
    """Of one stream."""
    min_text_agreement: float
    """Canary completions equal to the reference text."""
    text_max_latency_ratio: float
    """TTFT and inter-token latency: the Mann-Whitney rule with this ratio."""
    ttft_min_slowdown_ms: float
    """A time to first token counts as slower only when also this many ms above stable's (median difference)."""
    warmup_streams: int
    """Streams straight to the new version before the first step (discarded)."""
    clearly_slower_factor: float
    """Slower by more than a check's ratio times this fails at once; by less, the verdict is inconclusive."""
    max_analyses: int
    """Analyses of a step, each on fresh traffic, while its verdict is inconclusive; then it fails."""
    deploy_older_data: bool
    """Deploy a model whose data window ends before the champion's (else: a gate, exit 99)."""
    approval: Approval
    """A person in the loop: whether a run may go without one, who may answer, where the rollout holds and how long it waits."""

    def __post_init__(self) -> None:
        check(bool(self.steps) and self.steps[-1] == 100 and all(0 < s <= 100 for s in self.steps)
               and list(self.steps) == sorted(set(self.steps)), "steps", self.steps,
               "expected rising percentages ending at 100")
        check(not self.approval.active or self.approval.hold_before in self.steps, "approval.hold_before",
               self.approval.hold_before, f"expected one of steps {list(self.steps)}")
        positive(self, "step_duration_s", "rate_rps", "concurrency", "request_timeout_s", "max_latency_ratio",
                  "min_samples", "max_windows", "text_rps", "text_min_samples", "text_timeout_s",
                  "text_max_latency_ratio", "max_analyses")
        check(self.clearly_slower_factor >= 1, "clearly_slower_factor", self.clearly_slower_factor,
               "expected at least 1 (1: no inconclusive latency band)")
        fractions(self, "max_error_rate", "min_agreement", "latency_alpha", "min_text_agreement",
                   "shadow_min_stable_agreement")
        at_least_zero(self, "warmup_streams", "ttft_min_slowdown_ms")
