"""A vocabulary that grows (tasks/lib/vocabulary_growth.py), in this process: a byte-level BPE
trained on the demo's documents grown on the same documents in its drifted domain (Cyrillic
letters), and a model's embeddings grown with it (the train step's warm start)."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from tasks.drift import byte_fallback_ids
from tasks.lib.errors import StepError
from tasks.lib.model import FORMAT_VERSION, GPT, GPTConfig
from tasks.lib.model_store import save_model_files
from tasks.lib.tokens import BYTE_LEVEL_ALPHABET, tokenizer_hash, train_tokenizer
from tasks.lib.vocabulary_growth import Growth, grow, grown_rows
from tasks.seed import documents, transliterate
from tasks.train.trainer import initial_weights

MAX_NEW = 512


@pytest.fixture(scope="module")
def texts() -> dict[str, list[str]]:
    docs = [text for _, text in documents(3000)]
    return {"old": docs[:2000], "new": [transliterate(d) for d in docs[2000:2600]],
            "held_old": docs[2600:], "held_new": [transliterate(d) for d in docs[2600:]]}


@pytest.fixture(scope="module")
def parent(texts: dict[str, list[str]]) -> Any:
    return train_tokenizer(texts["old"], 4096)


@pytest.fixture(scope="module")
def grown(parent: Any, texts: dict[str, list[str]]) -> tuple[Any, Growth]:
    found = grow(parent, tokenizer_hash(parent.to_str()), texts["old"][:500] + texts["new"], MAX_NEW)
    assert found is not None
    return found


def fallback_share(tokenizer: Any, texts: list[str]) -> float:
    fallback = set(byte_fallback_ids(tokenizer.get_vocab()).tolist())
    ids = [i for t in texts for i in tokenizer.encode(t).ids]
    return float(np.mean([i in fallback for i in ids]))


def test_old_ids_and_old_text_unchanged(parent: Any, grown: tuple[Any, Growth], texts: dict[str, list[str]]) -> None:
    tokenizer, growth = grown
    old = parent.get_vocab()
    assert {t: i for t, i in tokenizer.get_vocab().items() if t in old} == old
    assert growth.first_id == parent.get_vocab_size() and tokenizer.get_vocab_size() == growth.vocab_size
    assert 0 < len(growth.pieces) <= MAX_NEW
    # text the old vocabulary covers is tokenized exactly as before; any text decodes back to itself
    for text in texts["held_old"]:
        assert tokenizer.encode(text).ids == parent.encode(text).ids
    for text in texts["held_new"][:100]:
        assert tokenizer.decode(tokenizer.encode(text).ids) == text


def test_drifted_text_no_longer_falls_back_to_bytes(parent: Any, grown: tuple[Any, Growth],
                                                     texts: dict[str, list[str]]) -> None:
    tokenizer, _ = grown
    before, after = fallback_share(parent, texts["held_new"]), fallback_share(tokenizer, texts["held_new"])
    assert before > 0.5 and after < 0.05, (before, after)
    tokens_before = sum(len(parent.encode(t).ids) for t in texts["held_new"])
    tokens_after = sum(len(tokenizer.encode(t).ids) for t in texts["held_new"])
    assert tokens_after < tokens_before / 2


def test_each_new_token_is_its_pieces(parent: Any, grown: tuple[Any, Growth]) -> None:
    tokenizer, growth = grown
    by_id = {i: t for t, i in tokenizer.get_vocab().items()}
    parent_by_id = {i: t for t, i in parent.get_vocab().items()}
    for offset, pieces in enumerate(growth.pieces):
        token = by_id[growth.first_id + offset]
        assert "".join(parent_by_id[p] for p in pieces) == token
        assert any(BYTE_LEVEL_ALPHABET[ch] >= 0x80 for ch in token)


def test_growth_is_deterministic(parent: Any, grown: tuple[Any, Growth], texts: dict[str, list[str]]) -> None:
    again = grow(parent, tokenizer_hash(parent.to_str()), texts["old"][:500] + texts["new"], MAX_NEW)
    assert again is not None
    assert again[0].to_str() == grown[0].to_str() and again[1] == grown[1]


def test_nothing_to_learn_from_ascii_text(parent: Any, texts: dict[str, list[str]]) -> None:
    assert grow(parent, "parent", texts["held_old"], MAX_NEW) is None


def test_refuses_a_tokenizer_that_is_not_byte_level() -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers

    words = Tokenizer(models.WordLevel({"a": 0, "[UNK]": 1}, unk_token="[UNK]"))
    words.pre_tokenizer = pre_tokenizers.Whitespace()
    with pytest.raises(StepError, match="grows byte-level BPE tokenizers only"):
        grow(words, "parent", ["привет"], MAX_NEW)


def test_growth_record_round_trip_and_bad_records(grown: tuple[Any, Growth]) -> None:
    _, growth = grown
    assert Growth.from_json(growth.to_json(), "here") == growth
    saved = json.loads(growth.to_json())
    for broken in ("{", json.dumps({**saved, "format": "other/1"}), json.dumps({**saved, "pieces": [[growth.first_id]]}),
                   json.dumps({**saved, "pieces": []}), json.dumps({k: v for k, v in saved.items() if k != "first_id"})):
        with pytest.raises(StepError, match="here: vocabulary growth cannot be read"):
            Growth.from_json(broken, "here")


def test_grown_rows_are_the_mean_of_their_pieces() -> None:
    weight = torch.randn(10, 4)
    growth = Growth("parent", 10, ((1, 2), (3,), (4, 5, 6)))
    rows = grown_rows(weight, growth)
    assert rows.shape == (13, 4) and torch.equal(rows[:10], weight)
    assert torch.allclose(rows[10], weight[[1, 2]].mean(0)) and torch.equal(rows[11], weight[3])
    with pytest.raises(StepError, match="cannot grow from id 10"):
        grown_rows(torch.randn(9, 4), growth)


@pytest.mark.parametrize("tied", [True, False])
def test_warm_start_grows_the_champions_embeddings(tmp_path: Path, tied: bool) -> None:
    """A model of the parent tokenizer starts a run of the grown one: its weights with rows added,
    so on old ids it computes what it did (the new ids' logits come after the old ones)."""
    config = GPTConfig(vocab_size=40, seq_len=16, d_model=32, n_layers=2, n_heads=2, tie_embeddings=tied)
    torch.manual_seed(0)
    champion = GPT(config).eval()
    description = {"architecture": "gpt", "format_version": FORMAT_VERSION, "config": config.to_dict(), "tokenizer_hash": "parent"}
    save_model_files(champion.state_dict(), description, tmp_path / "champion")
    (tmp_path / "champion" / "_SUCCESS").write_text("{}")
    growth = Growth("parent", 40, ((1, 2), (7,), (3, 4, 5)))
    grown_config = dataclasses.replace(config, vocab_size=growth.vocab_size)
    weights = initial_weights(str(tmp_path / "champion"), grown_config, "grown", None, growth)
    assert weights is not None
    model = GPT(grown_config).eval()
    model.load_state_dict(weights)
    ids = torch.randint(0, 40, (2, 12))
    with torch.no_grad():
        assert torch.allclose(model(ids)[..., :40], champion(ids), atol=1e-6)
    assert torch.allclose(model.embed.weight[40], champion.embed.weight[[1, 2]].mean(0))
    assert torch.equal(model.head.weight[41], champion.head.weight[7])
    # another tokenizer's growth, or another architecture: not this model's, it starts from scratch
    assert initial_weights(str(tmp_path / "champion"), grown_config, "grown", None,
                           dataclasses.replace(growth, parent_hash="other")) is None
    assert initial_weights(str(tmp_path / "champion"), dataclasses.replace(grown_config, n_layers=3), "grown", None,
                           growth) is None


def test_a_canary_of_a_grown_vocabulary_compares_what_the_old_one_covers() -> None:
    """Stable is sent the same logits inputs (cut before their first new id: it has no row for
    one) and its text compared on the prompts within the old vocabulary."""
    from tasks.deploy import covered_reference

    reference = {"inputs": [[[1, 2, 3]], [[4, 41, 5]], [[40, 6]]], "next_tokens": [[7, 8, 9], [10, 11, 12], [13, 14]],
                 "generations": [{"prompt": "old", "prompt_ids": [5, 6], "tokens": [7, 8]},
                                 {"prompt": "new prompt", "prompt_ids": [5, 41], "tokens": [7]},
                                 {"prompt": "new answer", "prompt_ids": [5], "tokens": [40]}]}
    kept = covered_reference(reference, 40)
    assert kept["inputs"] == [[[1, 2, 3]], [[4]]] and kept["next_tokens"] == [[7, 8, 9], [10]]
    assert [g["prompt"] for g in kept["generations"]] == ["old"]
    # no prompt covered: the text is still judged (against the new version's own reference) on all
    assert covered_reference(reference, 5)["generations"] == reference["generations"]
    with pytest.raises(StepError, match="cannot send both versions the same requests"):
        covered_reference(reference, 1)
