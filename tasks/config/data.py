"""The data half's sections: the demo generator (``seed``), ``snapshot``, ``validate``, ``tokenize``
and ``repro`` (`make repro`)."""

from __future__ import annotations

import dataclasses

from tasks.config.base import check, fractions, positive


@dataclasses.dataclass(frozen=True)
class SeedSettings:
    output: str
    """Where the demo generator writes raw partitions."""
    end_date: str
    """Last partition written (YYYY-MM-DD)."""
    days: int
    """Partitions written, ending on end_date."""
    max_documents: int
    """Docstrings of the installed Python software taken."""
    heldout_every: int
    """One document in this many is held out of every partition (the evaluation text)."""
    heldout_output: str
    """Where the held-out text goes."""

    def __post_init__(self) -> None:
        positive(self, "days", "max_documents", "heldout_every")


@dataclasses.dataclass(frozen=True)
class SnapshotSettings:
    max_record_bytes: int
    """A single raw record above this is rejected."""
    tag_prefix: str
    """Of the DVC registry's git tags (``data-...``)."""
    registry_dir: str
    """The DVC data registry's git repository (local)."""
    registry_remote: str
    """Its S3 remote."""
    registry_git_remote: str
    """A git URL to clone/push the registry (cluster mode); empty: local only."""
    learn_from_traffic: bool
    """A retrain the drift check started also trains on the captured prompts of the window that
    check read: scrubbed of personal data again, filtered by length and text, de-duplicated
    against the window's documents, capped at traffic_max_share, never the held-out slice the
    gate judges on (drift.heldout_fraction). Part of the data version (and so of the lineage).
    Off: captured traffic is never training data."""
    traffic_max_share: float
    """Most share of the snapshot's text bytes the captured prompts may take."""
    traffic_min_chars: int
    """A shorter captured prompt is not trained on."""
    traffic_max_chars: int
    """A longer captured prompt is not trained on."""

    def __post_init__(self) -> None:
        positive(self, "max_record_bytes", "traffic_min_chars")
        check(0 < self.traffic_max_share < 1, "traffic_max_share", self.traffic_max_share,
              "expected a share in (0, 1)")
        check(self.traffic_min_chars <= self.traffic_max_chars, "traffic_min_chars", self.traffic_min_chars,
              "expected at most traffic_max_chars")


@dataclasses.dataclass(frozen=True)
class ValidateSettings:
    min_records: int
    """Fewest records a snapshot may hold."""
    max_records: int
    """Most records a snapshot may hold."""
    min_text_chars: int
    """Shortest text within bounds."""
    max_text_chars: int
    """Longest text within bounds."""
    text_length_mostly: float
    """Share of records that must be within the length bounds."""
    max_duplicate_ratio: float
    """Share of raw records that were exact duplicates."""
    max_broken_text_ratio: float
    """Share of records with U+FFFD or control characters (mojibake)."""
    max_email_ratio: float
    """Share of records containing an e-mail-like string (PII)."""
    partition_min_share: float
    """A day's records relative to an even share of the window, at least."""
    partition_max_share: float
    """... and at most."""
    partition_max_repeated_ratio: float
    """Share of a day's records repeating a text seen earlier in the window."""

    def __post_init__(self) -> None:
        check(0 <= self.min_records <= self.max_records, "min_records", self.min_records, "expected 0 <= min <= max_records")
        check(0 < self.min_text_chars <= self.max_text_chars, "min_text_chars", self.min_text_chars,
               "expected 0 < min <= max_text_chars")
        fractions(self, "text_length_mostly", "max_duplicate_ratio", "max_broken_text_ratio", "max_email_ratio",
                   "partition_max_repeated_ratio")
        check(0 <= self.partition_min_share <= self.partition_max_share, "partition_min_share",
               self.partition_min_share, "expected 0 <= min <= partition_max_share")


@dataclasses.dataclass(frozen=True)
class TokenizeSettings:
    num_shards: int
    """Parallel encode tasks (pods in a cluster, processes locally)."""
    vocab_size: int
    """Of a newly trained byte-level BPE (ids stored as uint16)."""
    val_fraction: float
    """Documents held out for validation, by document hash."""
    batch_bytes: int
    """Snapshot bytes per encode_batch call."""
    tokenizer_store: str
    """Content-addressed tokenizers: ``sha256-<hash>/tokenizer.json``."""
    base_store: str
    """Imported base checkpoints (train.base) as model folders: ``sha256-<identity>/``."""
    grow_vocabulary: bool
    """A drift-started retrain whose drift check found byte fallback past its bound extends the
    champion's tokenizer with merges learned on the window's non-ASCII words (old ids and the
    tokenization of ASCII text unchanged) and resizes the model (tasks/lib/vocabulary_growth.py).
    Off: every retrain keeps its champion's vocabulary."""
    grow_max_tokens: int
    """Most tokens one growth adds."""

    def __post_init__(self) -> None:
        positive(self, "num_shards", "batch_bytes", "grow_max_tokens")
        check(256 < self.vocab_size <= 65536, "vocab_size", self.vocab_size, "expected 257..65536 (uint16 ids)")
        check(0 < self.val_fraction < 1, "val_fraction", self.val_fraction, "expected a fraction in (0, 1)")


@dataclasses.dataclass(frozen=True)
class ReproSettings:
    end_date: str
    """`make repro` (dvc repro) runs the data half for this interval end."""
    shards: tuple[str, ...]
    """One DVC encode stage per shard: ``f"{i:05d}"`` for each of tokenize.num_shards."""
