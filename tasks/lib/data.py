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

import hashlib
import json
import shutil
import tempfile
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Any

import numpy as np
import torch

from tasks.lib import storage
from tasks.lib.errors import StepError
from tasks.lib.parallel import Dist
from tasks.lib.tokens import SpecialTokens

DATASET_CACHE = Path(tempfile.gettempdir()) / "llm-pipeline-datasets"


def local_dataset(uri: str) -> Path:
    """The dataset folder on local disk (memory-mapping needs files; S3 is downloaded once per
    node). The node's copy is named by its manifest's hash, so it is only ever reused for the
    same content (a retry on this node skips the download); a failed download leaves nothing."""
    if not storage.is_s3(uri):
        storage.require_complete(uri)
        return Path(uri)
    manifest = storage.read_manifest(uri)
    manifest_text = json.dumps(manifest, indent=1, sort_keys=True).encode()
    cache = DATASET_CACHE / hashlib.sha256(manifest_text).hexdigest()[:24]
    if not (cache / storage.SUCCESS_MARKER).exists():
        # ranks of a node race to the same folder: each downloads aside, the first rename wins
        cache.parent.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(prefix=f".{cache.name}-", dir=cache.parent))
        try:
            storage.download_tree(uri, staging, manifest)
            (staging / storage.SUCCESS_MARKER).write_bytes(manifest_text)
            staging.rename(cache)
        except OSError as exc:
            if not (cache / storage.SUCCESS_MARKER).exists():
                raise RuntimeError(f"{uri}: node-local copy failed ({exc})") from None
        finally:
            shutil.rmtree(staging, ignore_errors=True)  # the loser's copy, or a failed download's
    return cache


def drop_local_dataset(dataset_dir: Path, env: Dist) -> None:
    """After a successful run: the node's copy goes (one process per node, once all are done)."""
    if DATASET_CACHE in dataset_dir.parents and env.local_rank == 0:
        shutil.rmtree(dataset_dir, ignore_errors=True)


@dataclass(frozen=True)
class TokenSplit:
    tokens: np.memmap[Any, Any]
    vocab_size: int
    eos_id: int
    tokenizer_uri: str
    tokenizer_hash: str
    special_tokens: SpecialTokens
    index: dict[str, Any] = field(default_factory=dict)  # the dataset's index.json (how it was split)


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
        # datasets tokenized before checkpoints' tokenizers: the pipeline's convention (EOS alone)
        special_tokens=SpecialTokens.from_dict(index.get("special_tokens") or {"eos_ids": [index["eos_id"]]},
                                               str(index_path)),
        index={k: v for k, v in index.items() if k != "splits"},
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
