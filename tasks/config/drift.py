"""The ``drift`` section: the check of served traffic against the champion's training data."""

from __future__ import annotations

import dataclasses

from tasks.config.base import at_least_zero, check, fractions, positive


@dataclasses.dataclass(frozen=True)
class DriftSettings:
    dag_id: str
    """The drift check's DAG."""
    schedule: str
    """Its cron (it also runs on each closed capture partition's Asset event)."""
    served_asset: str
    """The Airflow Asset of the captured traffic (its URI: serve.capture.uri)."""
    window_h: float
    """The captured requests of this many hours before the check are compared."""
    min_prompts: int
    """Fewer captured prompts in the window: no verdict (too little traffic to judge), nothing started."""
    max_prompts: int
    """At most this many prompts are read (a random sample of the window's, seeded)."""
    reference_tokens: int
    """Tokens of the champion's validation split the window is compared with."""
    null_samples: int
    """Samples of the reference as large as the window's, to know how far a sample of the same size strays by chance."""
    max_js_excess: float
    """Token distribution: Jensen-Shannon divergence (bits) above what samples of the reference reach by chance."""
    max_byte_fallback_excess: float
    """Share of byte-fallback tokens (non-ASCII bytes the vocabulary never merged) above the reference's."""
    max_perplexity_ratio: float
    """The champion's perplexity on the prompts over its perplexity on reference text of the same lengths."""
    max_prompt_tokens: int
    """A prompt counts with at most this many tokens: a handful of huge prompts cannot make the token distribution."""
    min_clients: int
    """Drift must be seen in the prompts of at least this many distinct clients (hashed addresses) for a verdict."""
    cooldown_h: float
    """After drift started a retrain, no other for the same champion for this long."""
    state_uri: str
    """Where the last retrain the drift check started is recorded."""
    heldout_fraction: float
    """Of a window's distinct captured prompts (by prompt hash): never trained on
    (snapshot.learn_from_traffic may train on the rest); the gate of a retrain the drift check
    started judges the challenger on these."""

    def __post_init__(self) -> None:
        positive(self, "window_h", "min_prompts", "max_prompts", "reference_tokens", "null_samples",
                  "max_perplexity_ratio", "max_prompt_tokens", "min_clients")
        at_least_zero(self, "max_js_excess", "cooldown_h")
        fractions(self, "max_byte_fallback_excess", "heldout_fraction")
        check(self.heldout_fraction > 0, "heldout_fraction", self.heldout_fraction,
              "expected a share above 0 (the gate judges a drift-started retrain on it)")
