"""Tokenizer training/loading and the on-disk token dataset format.

Dataset layout (what ``tokenize merge`` writes and training memory-maps):

    index.json            dtype, vocab, tokenizer hash, special tokens, per split: documents, tokens, files
    train.bin / val.bin   concatenated token ids (each document framed by :meth:`SpecialTokens.frame`:
                          a BOS first where the model wants one, its EOS last), ``dtype``
    train.offsets.npy     int64, documents + 1 entries: document d is bin[offsets[d]:offsets[d+1]]
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Iterable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from tasks.lib import storage
from tasks.lib.errors import StepError

EOS = "<|endoftext|>"
PAD = "<|pad|>"
SPECIAL_TOKENS = [EOS, PAD]
SPLITS = ("train", "val")
# a stored tokenizer's folder: its tokenizer.json and, for a checkpoint's tokenizer, the special
# tokens its model uses and the checkpoint's tokenizer_config.json (its chat template): the folder
# is named by the hash of all of them (Llama 3's base and instruct share a tokenizer.json, not an EOS)
TOKENIZER_FILE, SPECIAL_TOKENS_FILE, TOKENIZER_CONFIG_FILE = "tokenizer.json", "special_tokens.json", "tokenizer_config.json"
# a grown tokenizer's: its parent and the parent's pieces of each new token (tasks/lib/vocabulary_growth.py)
GROWTH_FILE = "growth.json"
COMPANION_FILES = (SPECIAL_TOKENS_FILE, TOKENIZER_CONFIG_FILE, GROWTH_FILE)


def byte_level_alphabet() -> dict[str, int]:
    """Byte-level BPE's characters and the bytes they stand for (GPT-2's bytes_to_unicode:
    visible bytes as themselves, the others as characters from U+0100 up)."""
    visible = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    alphabet, extra = {}, 0
    for byte in range(256):
        if byte in visible:
            alphabet[chr(byte)] = byte
        else:
            alphabet[chr(256 + extra)] = byte
            extra += 1
    return alphabet


BYTE_LEVEL_ALPHABET = byte_level_alphabet()


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
        """As JSON holds it (the EOS ids a list)."""
        return {**asdict(self), "eos_ids": list(self.eos_ids)}

    @classmethod
    def from_dict(cls, saved: dict[str, Any], where: str) -> SpecialTokens:
        try:
            eos = tuple(int(i) for i in saved["eos_ids"])
            if not eos:
                raise ValueError("no eos_ids")
            return cls(eos, None if saved.get("bos_id") is None else int(saved["bos_id"]),
                       None if saved.get("pad_id") is None else int(saved["pad_id"]), bool(saved.get("add_bos", False)))
        except (KeyError, TypeError, ValueError) as exc:
            raise StepError(f"{where}: special tokens {saved!r} cannot be read ({exc})") from None

    @property
    def prefix(self) -> list[int]:
        """What opens every sequence the model reads: its BOS, where it wants one."""
        return [self.bos_id] if self.add_bos and self.bos_id is not None else []

    def frame(self, ids: list[int]) -> list[int]:
        """A training document: the prefix, its ids, the (first) EOS, which also separates documents."""
        return [*self.prefix, *ids, self.eos_ids[0]]


def our_special_tokens(tokenizer: Any, where: str = "the tokenizer") -> SpecialTokens:
    """The pipeline's own convention: ``<|endoftext|>`` ends and separates, no BOS."""
    eos = tokenizer.token_to_id(EOS)
    if eos is None:
        raise StepError(f"{where}: tokenizer has no {EOS} token (and no {SPECIAL_TOKENS_FILE} beside it)")
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


def tokenizer_hash(serialized: str, companions: dict[str, str] | None = None) -> str:
    """The content address of a tokenizer: its tokenizer.json, with a checkpoint's companion
    files (name: text) when it has any (ours has none: their hash is the file's alone)."""
    digest = hashlib.sha256(serialized.encode("utf-8"))
    for name in sorted(companions or {}):
        digest.update(b"\0" + name.encode() + b"\0" + (companions or {})[name].encode("utf-8"))
    return digest.hexdigest()


@dataclass(frozen=True)
class Vocabulary:
    """A stored tokenizer with what its model frames text with: the one way every step reads one."""

    tokenizer: Any
    special: SpecialTokens
    hash: str
    file: Path  # the tokenizer.json read (a local copy of a stored one)
    companions: dict[str, str] = field(default_factory=dict)  # a checkpoint's: special_tokens.json, tokenizer_config.json; a grown one's growth.json

    @property
    def chat_config(self) -> str | None:
        """The checkpoint's tokenizer_config.json (its chat template), if it came with one."""
        return self.companions.get(TOKENIZER_CONFIG_FILE)


def companions_of(uri: str) -> dict[str, str]:
    """The companion files stored beside the tokenizer.json at ``uri`` (name: text)."""
    return {name: storage.read_bytes(storage.sibling(uri, name)).decode("utf-8")
            for name in COMPANION_FILES if storage.exists(storage.sibling(uri, name))}


def stored_hash(uri: str) -> str:
    """The content hash of the stored tokenizer at ``uri`` (what its folder is named by)."""
    return tokenizer_hash(storage.read_bytes(uri).decode("utf-8"), companions_of(uri))


def load_vocabulary(uri: str, scratch: Path) -> Vocabulary:
    """The tokenizer.json at ``uri`` and its companions beside it; one named ``sha256-<hash>/``
    must hash to its name (else a partial or replaced write: transient)."""
    from tokenizers import Tokenizer

    path = storage.download(uri, scratch / TOKENIZER_FILE)
    companions = companions_of(uri)
    digest = tokenizer_hash(path.read_text(encoding="utf-8"), companions)
    named = re.search(r"sha256-([0-9a-f]{64})/tokenizer\.json$", uri)
    if named and digest != named.group(1):
        raise storage.StorageUnavailable(f"{uri}: its content does not hash to its name (a partial or replaced write)")
    try:
        tokenizer = Tokenizer.from_file(str(path))
    except Exception as exc:  # tokenizers raises a bare Exception on bad files
        raise StepError(f"{uri}: not a valid tokenizer file ({exc})") from None
    if SPECIAL_TOKENS_FILE in companions:
        try:
            saved = json.loads(companions[SPECIAL_TOKENS_FILE])
        except json.JSONDecodeError as exc:
            raise StepError(f"{storage.sibling(uri, SPECIAL_TOKENS_FILE)}: not JSON ({exc.msg})") from None
        special = SpecialTokens.from_dict(saved, storage.sibling(uri, SPECIAL_TOKENS_FILE))
    else:
        special = our_special_tokens(tokenizer, uri)
    return Vocabulary(tokenizer, special, digest, path, companions)


def store_vocabulary(tokenizer: Any, store: str, companions: dict[str, str] | None = None) -> tuple[str, str]:
    """``tokenizer`` (with a checkpoint's companion files) in the content-addressed ``store``:
    (the URI of its tokenizer.json, its hash). Written once, never replaced or deleted (other
    runs may be reading it)."""
    serialized = tokenizer.to_str()
    digest = tokenizer_hash(serialized, companions)
    folder = storage.join(store, f"sha256-{digest}")
    if not storage.exists(storage.join(folder, storage.SUCCESS_MARKER)):
        with storage.staged_output(folder, write_once=True) as out:
            (out / TOKENIZER_FILE).write_text(serialized, encoding="utf-8")
            for name, text in (companions or {}).items():
                (out / name).write_text(text, encoding="utf-8")
    return storage.join(folder, TOKENIZER_FILE), digest


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
    lines: Iterable[bytes], batch_bytes: int, where: str, first_line: int = 1, required: tuple[str, ...] = ()
) -> Iterator[list[dict[str, Any]]]:
    """JSON records of ``lines`` in batches of about ``batch_bytes`` of input each: memory stays
    bounded by the batch however long the documents, and an ``encode_batch`` call is long enough
    that its threads rarely wait for its longest document. Each record must be an object with a
    string at each ``required`` field. Errors name ``where`` and the line (``lines`` start at
    line ``first_line`` of it)."""
    batch: list[dict[str, Any]] = []
    size = 0
    for number, line in enumerate(lines, first_line):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as exc:
            raise StepError(f"{where}: line {number} is not a JSON record ({exc.msg})") from None
        missing = [f for f in required if not isinstance(record, dict) or not isinstance(record.get(f), str)]
        if missing:
            raise StepError(f"{where}: line {number} has no string {', '.join(missing)} (a snapshot record, as "
                            "tasks.snapshot writes one, has text and content_hash)")
        batch.append(record)
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
