"""A vocabulary that grows: new BPE merges learned on new text, appended to a byte-level BPE.

A drift-started retrain may extend its champion's tokenizer when the drifted traffic splits into
single bytes (``tokenize.grow_vocabulary``). What grows, and what does not:

- Old ids keep their meaning: new tokens take the ids after the last one, new merges come after
  every old merge (BPE applies merges by rank, so an old merge always wins).
- Text the old vocabulary covers is tokenized exactly as before: every new token holds a byte
  >= 0x80, so no new merge can fire inside an ASCII-only word. Learning runs on the words of the
  new text that hold such bytes, with tokenizers' own BPE trainer.
- Each new token is recorded with its pieces under the parent tokenizer (``growth.json`` beside
  the grown tokenizer.json, part of its content hash): training resizes the parent's embeddings
  and head, each new row the mean of its pieces' rows (:func:`grown_rows`), so a replay rebuilds
  the same weights.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from tasks.lib import storage
from tasks.lib.errors import StepError
from tasks.lib.tokens import BYTE_LEVEL_ALPHABET, GROWTH_FILE, companions_of

if TYPE_CHECKING:
    import torch

FORMAT = "llm-pipeline-vocabulary-growth/1"


@dataclass(frozen=True)
class Growth:
    """New tokens appended to a parent tokenizer (by its content hash): ids ``first_id`` on, each
    with the parent's ids its text split into."""

    parent_hash: str
    first_id: int
    pieces: tuple[tuple[int, ...], ...]

    @property
    def vocab_size(self) -> int:
        """Of the grown tokenizer (and of a model of it)."""
        return self.first_id + len(self.pieces)

    def to_json(self) -> str:
        return json.dumps({"format": FORMAT, "parent_hash": self.parent_hash, "first_id": self.first_id,
                           "pieces": [list(p) for p in self.pieces]}, indent=0)

    @classmethod
    def from_json(cls, text: str, where: str) -> Growth:
        try:
            saved = json.loads(text)
            if saved.get("format") != FORMAT:
                raise ValueError(f"format {saved.get('format')!r}, expected {FORMAT}")
            pieces = tuple(tuple(int(i) for i in p) for p in saved["pieces"])
            first = int(saved["first_id"])
            if not pieces or any(not p or min(p) < 0 or max(p) >= first for p in pieces):
                raise ValueError("every new token needs pieces among the parent's ids")
            return cls(str(saved["parent_hash"]), first, pieces)
        except (json.JSONDecodeError, AttributeError, KeyError, TypeError, ValueError) as exc:
            raise StepError(f"{where}: vocabulary growth cannot be read ({exc})") from None


def growth_of(tokenizer_uri: str) -> Growth | None:
    """What the stored tokenizer at ``tokenizer_uri`` added to its parent's vocabulary, if it grew."""
    text = companions_of(tokenizer_uri).get(GROWTH_FILE)
    return None if text is None else Growth.from_json(text, storage.sibling(tokenizer_uri, GROWTH_FILE))


def holds_high_byte(token: str) -> bool:
    """Whether a byte-level token holds a byte >= 0x80 (a piece of a non-ASCII character)."""
    return any(BYTE_LEVEL_ALPHABET.get(ch, 0) >= 0x80 for ch in token)


def check_byte_level(tokenizer: Any, where: str) -> dict[str, Any]:
    """The tokenizer's JSON, if it is a byte-level BPE (ours, GPT-2's): else bad input."""
    saved: dict[str, Any] = json.loads(tokenizer.to_str())
    model, pre = saved.get("model") or {}, json.dumps(saved.get("pre_tokenizer"))
    if model.get("type") != "BPE" or '"ByteLevel"' not in pre or model.get("byte_fallback"):
        raise StepError(f"{where}: tokenize.grow_vocabulary grows byte-level BPE tokenizers only (this one is a "
                        f"{model.get('type')} with pre-tokenizer {pre[:60]})")
    return saved


def words_to_learn(tokenizer: Any, texts: Iterable[str]) -> Iterator[str]:
    """The words (as the tokenizer's pre-tokenizer splits text) that hold non-ASCII characters."""
    for text in texts:
        if text.isascii():
            continue
        for piece, (start, end) in tokenizer.pre_tokenizer.pre_tokenize_str(text):
            if holds_high_byte(piece):
                yield text[start:end]


def learned_merges(words: Iterable[str], max_new: int, min_frequency: int) -> list[tuple[str, str]]:
    """BPE merges learned on ``words`` alone (from single bytes up), in the order learned."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    learner = Tokenizer(models.BPE())
    learner.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    # the learner relearns the old vocabulary's merges of the words' ASCII parts too: room for them
    trainer = trainers.BpeTrainer(vocab_size=len(alphabet) + 4 * max_new, min_frequency=min_frequency,
                                  initial_alphabet=alphabet, show_progress=False)
    learner.train_from_iterator(words, trainer=trainer)
    merges = json.loads(learner.to_str())["model"]["merges"]
    return [tuple(m) if isinstance(m, list) else tuple(m.split(" ", 1)) for m in merges]  # type: ignore[misc]


def grow(tokenizer: Any, parent_hash: str, texts: Iterable[str], max_new: int,
         min_frequency: int = 2) -> tuple[Any, Growth] | None:
    """``tokenizer`` with up to ``max_new`` tokens learned on ``texts`` (None: nothing new to learn)."""
    from tokenizers import Tokenizer

    saved = check_byte_level(tokenizer, "the champion's tokenizer")
    vocab: dict[str, int] = saved["model"]["vocab"]
    merges: list[Any] = saved["model"]["merges"]
    as_lists = not merges or isinstance(merges[0], list)
    next_id = max(tokenizer.get_vocab(with_added_tokens=True).values()) + 1
    first_id, pieces = next_id, []
    for left, right in learned_merges(words_to_learn(tokenizer, texts), max_new, min_frequency):
        merged = left + right
        # an operand the old vocabulary lacks (an ASCII merge the learner made) cannot fire here
        if merged in vocab or left not in vocab or right not in vocab or not holds_high_byte(merged):
            continue
        pieces.append(tuple(t.id for t in tokenizer.model.tokenize(merged)))
        vocab[merged] = next_id
        merges.append([left, right] if as_lists else f"{left} {right}")
        next_id += 1
        if len(pieces) == max_new:
            break
    if not pieces:
        return None
    return Tokenizer.from_str(json.dumps(saved)), Growth(parent_hash, first_id, tuple(pieces))


def grown_rows(weight: torch.Tensor, growth: Growth) -> torch.Tensor:
    """An embedding (or untied head) matrix of the parent's vocabulary with a row per new token
    appended: the mean of its pieces' rows (the token starts out as what it replaces, on average)."""
    import torch

    if weight.shape[0] != growth.first_id:
        raise StepError(f"a {weight.shape[0]}-row embedding cannot grow from id {growth.first_id} "
                        "(the parent model's vocabulary is not the grown tokenizer's parent)")
    new = torch.stack([weight[list(p)].mean(dim=0) for p in growth.pieces])
    return torch.cat([weight, new.to(weight.dtype)])
