"""Tokenizer training/loading and the on-disk token dataset format.

Dataset layout (what ``tokenize merge`` writes and training memory-maps):

    index.json            dtype, vocab, tokenizer hash, per split: documents, tokens, files
    train.bin / val.bin   concatenated token ids (each document ends with EOS), ``dtype``
    train.offsets.npy     int64, documents + 1 entries: document d is bin[offsets[d]:offsets[d+1]]
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Iterable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

from tasks.lib import storage
from tasks.lib.errors import StepError

EOS = "<|endoftext|>"
PAD = "<|pad|>"
SPECIAL_TOKENS = [EOS, PAD]
SPLITS = ("train", "val")


@dataclass(frozen=True)
class SpecialTokens:
    """The ids a model's text is framed with: generation ends at any of ``eos_ids`` (the first
    also separates documents in training data), ``bos_id`` opens a sequence where ``add_bos``,
    ``pad_id`` pads. Ours (:func:`our_special_tokens`), or a checkpoint's
    (:func:`tasks.lib.hf_checkpoint.checkpoint_special_tokens`)."""

    eos_ids: tuple[int, ...]
    bos_id: int | None = None
    pad_id: int | None = None
    add_bos: bool = False

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def our_special_tokens(tokenizer: Any) -> SpecialTokens:
    """The pipeline's own convention: ``<|endoftext|>`` ends and separates, no BOS."""
    eos = tokenizer.token_to_id(EOS)
    if eos is None:
        raise StepError(f"the tokenizer has no {EOS} token")
    return SpecialTokens((eos,), None, tokenizer.token_to_id(PAD))


def token_dtype(vocab_size: int) -> np.dtype[Any]:
    """The smallest unsigned dtype that holds every token id."""
    if vocab_size <= 0:
        raise StepError(f"vocab size {vocab_size}: must be positive")
    return np.dtype(np.uint16) if vocab_size <= np.iinfo(np.uint16).max + 1 else np.dtype(np.uint32)


def split_of(content_hash: str, val_fraction: float) -> str:
    """Train/val assignment by document hash: independent of sharding and of record order."""
    return "val" if int(content_hash[:8], 16) / 2**32 < val_fraction else "train"


def train_tokenizer(texts: Iterable[str], vocab_size: int, count: int | None = None) -> Any:
    """A byte-level BPE (GPT-2 style) trained on ``texts``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(texts, trainer=trainer, length=count)
    return tokenizer


def tokenizer_hash(serialized: str) -> str:
    return hashlib.sha256(serialized.encode("utf-8")).hexdigest()


def load_tokenizer(uri: str, scratch: Path) -> Any:
    from tokenizers import Tokenizer

    path = storage.download(uri, scratch / "tokenizer.json")
    named = re.search(r"sha256-([0-9a-f]{64})/tokenizer\.json$", uri)
    if named and tokenizer_hash(path.read_text(encoding="utf-8")) != named.group(1):
        raise storage.StorageUnavailable(f"{uri}: its content does not hash to its name (a partial or replaced write)")
    try:
        tokenizer = Tokenizer.from_file(str(path))
    except Exception as exc:  # tokenizers raises a bare Exception on bad files
        raise StepError(f"{uri}: not a valid tokenizer file ({exc})") from None
    if tokenizer.token_to_id(EOS) is None:
        raise StepError(f"{uri}: tokenizer has no {EOS} token")
    return tokenizer


def lines_in(chunks: Iterable[bytes]) -> Iterator[bytes]:
    """The lines (without their newline) of a byte stream that arrives in arbitrary chunks."""
    rest = b""
    for chunk in chunks:
        lines = (rest + chunk).split(b"\n")
        rest = lines.pop()
        yield from lines
    if rest:
        yield rest


def record_batches(
    lines: Iterable[bytes], batch_bytes: int, where: str, first_line: int = 1
) -> Iterator[list[dict[str, Any]]]:
    """JSON records of ``lines`` in batches of about ``batch_bytes`` of input each: memory stays
    bounded by the batch however long the documents, and an ``encode_batch`` call is long enough
    that its threads rarely wait for its longest document. Errors name ``where`` and the line
    (``lines`` start at line ``first_line`` of it)."""
    batch: list[dict[str, Any]] = []
    size = 0
    for number, line in enumerate(lines, first_line):
        if not line.strip():
            continue
        try:
            batch.append(json.loads(line))
        except json.JSONDecodeError as exc:
            raise StepError(f"{where}: line {number} is not a JSON record ({exc.msg})") from None
        size += len(line)
        if size >= batch_bytes:
            yield batch
            batch, size = [], 0
    if batch:
        yield batch


def read_jsonl(path: Path) -> Iterator[dict[str, Any]]:
    with path.open("rb") as fh:
        for line in fh:
            if line.strip():
                yield json.loads(line)


def shard_range(offsets: np.ndarray[Any, Any], index: int, num_shards: int) -> tuple[int, int]:
    """Contiguous record range ``[start, end)`` of shard ``index`` of ``num_shards``, holding about
    an equal share of the snapshot's bytes (record ``i`` is bytes ``offsets[i]:offsets[i+1]``).
    Records differ in length by orders of magnitude: equal record counts had given one of two
    shards 65% of the tokens, and the busiest shard bounds the step."""
    if num_shards < 1 or not 0 <= index < num_shards:
        raise StepError(f"shard {index} of {num_shards}: invalid shard index")
    total = int(offsets[-1])

    def boundary(k: int) -> int:  # the first record starting at or after k/N of the bytes
        return int(np.searchsorted(offsets, total * k // num_shards, side="left")) if k < num_shards else len(offsets) - 1

    return boundary(index), boundary(index + 1)


def offsets_from_lengths(lengths: np.ndarray[Any, Any]) -> np.ndarray[Any, Any]:
    offsets = np.zeros(len(lengths) + 1, dtype=np.int64)
    np.cumsum(lengths, out=offsets[1:])
    return offsets
