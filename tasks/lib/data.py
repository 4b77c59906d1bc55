"""Training batches from the tokenize step's memory-mapped token files.

The token stream of a split is cut into non-overlapping windows of ``seq_len + 1`` tokens.
Each epoch visits every window once in an order fixed by (seed, epoch). Sample ``g`` of the
global sequence is window ``order(epoch)[g % windows]``; at every micro-step rank ``r`` of
``world`` takes the ``r``-th slice of the next ``micro_batch * world`` samples. The only state
is the number of global samples consumed, which goes into every checkpoint: a resume neither
repeats nor skips a batch, and with the same global batch it continues the same sequence
whatever the world size.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any

import numpy as np
import torch

from tasks.lib.errors import StepError


@dataclass(frozen=True)
class TokenSplit:
    tokens: np.memmap[Any, Any]
    vocab_size: int
    eos_id: int
    tokenizer_uri: str
    tokenizer_hash: str


def open_split(dataset_dir: Path, split: str) -> TokenSplit:
    """Memory-map one split of a tokenized dataset, checking it against its index."""
    index_path = dataset_dir / "index.json"
    if not index_path.exists():
        raise StepError(f"{dataset_dir}: no index.json (not a tokenized dataset)")
    index = json.loads(index_path.read_text())
    info = index["splits"].get(split)
    if info is None:
        raise StepError(f"{index_path}: no {split!r} split")
    path = dataset_dir / info["bin"]
    if not path.exists():
        raise StepError(f"{path}: token file missing")
    dtype = np.dtype(index["dtype"])
    size = path.stat().st_size
    if size == 0 or info["tokens"] == 0:
        raise StepError(f"{path}: token file is empty")
    if size != info["tokens"] * dtype.itemsize:
        raise StepError(f"{path}: {size} bytes, but index.json says {info['tokens']} {dtype.name} tokens")
    return TokenSplit(
        tokens=np.memmap(path, dtype=dtype, mode="r"),
        vocab_size=int(index["vocab_size"]),
        eos_id=int(index["eos_id"]),
        tokenizer_uri=str(index["tokenizer_uri"]),
        tokenizer_hash=str(index["tokenizer_hash"]),
    )


class BatchSampler:
    def __init__(self, tokens: np.memmap[Any, Any], seq_len: int, micro_batch: int, seed: int) -> None:
        self.tokens, self.seq_len, self.micro_batch, self.seed = tokens, seq_len, micro_batch, seed
        self.windows = (len(tokens) - 1) // seq_len
        if self.windows < 1:
            raise StepError(f"{len(tokens)} tokens cannot fill one sequence of {seq_len} + 1")

    @lru_cache(maxsize=2)  # noqa: B019 - two epochs at most are live; the sampler lives as long as training
    def _order(self, epoch: int) -> np.ndarray[Any, Any]:
        return np.random.default_rng([self.seed, epoch]).permutation(self.windows)

    def sample(self, g: int) -> np.ndarray[Any, Any]:
        epoch, pos = divmod(g, self.windows)
        start = int(self._order(epoch)[pos]) * self.seq_len
        return np.asarray(self.tokens[start : start + self.seq_len + 1], dtype=np.int64)

    def batch(self, samples_seen: int, rank: int, world: int) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's micro-batch of the ``micro_batch * world`` samples after ``samples_seen``."""
        first = samples_seen + rank * self.micro_batch
        rows = np.stack([self.sample(g) for g in range(first, first + self.micro_batch)])
        data = torch.from_numpy(rows)
        return data[:, :-1], data[:, 1:]

    def epoch_of(self, samples_seen: int) -> float:
        return samples_seen / self.windows
