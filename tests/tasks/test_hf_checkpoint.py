"""A team's Hugging Face checkpoint read as our model, and our model written back as one.

Every checkpoint here is built offline by transformers itself (``LlamaConfig``, ``MistralConfig``,
``Qwen2Config`` + ``save_pretrained``, random weights: no download), and transformers runs it
for the reference logits.
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import pytest
import torch

from tasks.lib.hf_checkpoint import (
    CheckpointError,
    checkpoint_config,
    hf_weights,
    read_checkpoint,
    transformers_logits,
    write_checkpoint,
)
from tasks.lib.model import GPT, empty_cache
from tasks.lib.tokens import EOS, PAD, load_vocabulary

VOCAB, CONTEXT = 97, 32


def family_config(family: str, **options: Any) -> Any:
    """A tiny transformers configuration of ``family`` (options as transformers names them)."""
    from transformers import LlamaConfig, MistralConfig, Qwen2Config

    common = {"vocab_size": VOCAB, "hidden_size": 32, "intermediate_size": 48, "num_hidden_layers": 2,
              "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": CONTEXT,
              "rms_norm_eps": 1e-5, "tie_word_embeddings": False, "attn_implementation": "eager", **options}
    if family == "mistral":
        return MistralConfig(sliding_window=None, **common)
    if family == "qwen2":
        return Qwen2Config(**common)
    return LlamaConfig(**common)


def random_options(family: str, seed: int) -> dict[str, Any]:
    """A random draw of what the family lets a checkpoint choose (heads, key/value heads, head
    size, tied head, biases, rotary base and scaling)."""
    rng = random.Random(seed)
    heads = rng.choice((2, 4, 8))
    options: dict[str, Any] = {
        "num_attention_heads": heads, "num_key_value_heads": rng.choice([k for k in (1, 2, 4, 8) if heads % k == 0]),
        "head_dim": rng.choice((4, 8, 16)), "tie_word_embeddings": rng.random() < 0.5,
        "rope_theta": rng.choice((10000.0, 500000.0))}
    if family == "llama":
        options |= {"attention_bias": rng.random() < 0.5, "mlp_bias": rng.random() < 0.5}
        options["rope_scaling"] = rng.choice((
            None, {"rope_type": "linear", "factor": 2.0},
            {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
             "original_max_position_embeddings": 8}))
    return options


def saved_checkpoint(folder: Path, family: str, seed: int = 0, shard_size: str | None = None,
                     **options: Any) -> Any:
    """A transformers model of ``family`` with random weights (biases too), saved to ``folder``."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    theirs = AutoModelForCausalLM.from_config(family_config(family, **options)).eval()
    with torch.no_grad():
        for name, param in theirs.named_parameters():
            if name.endswith(".bias"):  # transformers starts them at zero: a mix-up would not show
                param.normal_(0.0, 0.1)
    theirs.save_pretrained(str(folder), **({"max_shard_size": shard_size} if shard_size else {}))
    return theirs


def their_logits(model: Any, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(ids).logits  # type: ignore[no-any-return]


CASES = [("llama", seed) for seed in range(4)] + [("mistral", seed) for seed in range(2)] + [
    ("qwen2", seed) for seed in range(2)]


@pytest.mark.parametrize(("family", "seed"), CASES, ids=[f"{f}-{s}" for f, s in CASES])
def test_a_checkpoint_reads_as_our_model_with_transformers_logits(family: str, seed: int, tmp_path: Path) -> None:
    """Random tiny configurations of each family: our forward (the whole window, as training and
    evaluation run it) and our cached forward (a prefill, then one token at a time against a
    cache of the key/value heads only, as serving runs it) give transformers' logits."""
    options = random_options(family, seed)
    theirs = saved_checkpoint(tmp_path, family, seed, **options)
    ours = read_checkpoint(tmp_path)
    c = ours.config
    assert (c.n_heads, c.n_kv_heads, c.head_dim) == (options["num_attention_heads"], options["num_key_value_heads"],
                                                     options["head_dim"])
    assert c.tie_embeddings == options["tie_word_embeddings"] and c.qkv_bias == (
        family == "qwen2" or options.get("attention_bias", False))
    ids = torch.randint(0, VOCAB, (2, CONTEXT), generator=torch.Generator().manual_seed(seed))
    expected = their_logits(theirs, ids)
    with torch.no_grad():
        assert torch.allclose(ours(ids), expected, atol=1e-4), (ours(ids) - expected).abs().max()
        prompt = 5
        past_k, past_v = empty_cache(c, 2)
        logits, past_k, past_v = ours.forward_cached(ids[:, :prompt], past_k, past_v, torch.zeros(2, dtype=torch.long))
        assert past_k.shape == (c.n_layers, 2, c.n_kv_heads, prompt, c.head_dim)
        assert torch.allclose(logits, expected[:, prompt - 1], atol=1e-4)
        for position in range(prompt, prompt + 4):
            lengths = torch.full((2,), past_k.shape[3], dtype=torch.long)
            logits, k, v = ours.forward_cached(ids[:, position:position + 1], past_k, past_v, lengths)
            past_k, past_v = torch.cat((past_k, k), dim=3), torch.cat((past_v, v), dim=3)
            assert torch.allclose(logits, expected[:, position], atol=1e-4), position


def tokenizer_file(folder: Path) -> Path:
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel

    vocab = {EOS: 0, PAD: 1, **{f"w{i}": i for i in range(2, VOCAB)}}
    path = folder / "tokenizer.json"
    Tokenizer(WordLevel(vocab, unk_token=EOS)).save(str(path))
    return path


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_import_then_export_gives_back_the_same_tensors(family: str, tmp_path: Path) -> None:
    """Read from sharded safetensors (the index and its shards), written back as one file: the
    same tensor under every name, a config transformers loads to the same logits."""
    from safetensors import safe_open

    options = random_options("llama", 1) | {"tie_word_embeddings": False}
    if family == "qwen2":
        options = {k: v for k, v in options.items() if k not in ("attention_bias", "mlp_bias", "rope_scaling")}
    theirs = saved_checkpoint(tmp_path / "in", family, 1, shard_size="20KB", **options)
    assert (tmp_path / "in" / "model.safetensors.index.json").exists()
    ours = read_checkpoint(tmp_path / "in")
    out = write_checkpoint(ours, load_vocabulary(str(tokenizer_file(tmp_path)), tmp_path), tmp_path / "out")
    original = theirs.state_dict()
    with safe_open(str(out / "model.safetensors"), "pt") as written:
        names = set(written.keys())
        assert names == {n for n in original if not n.endswith("rotary_emb.inv_freq")}
        for name in names:
            assert torch.equal(written.get_tensor(name), original[name]), name
    config = json.loads((out / "config.json").read_text())
    assert config["model_type"] == family and config["num_key_value_heads"] == options["num_key_value_heads"]
    ids = torch.randint(0, VOCAB, (2, 12), generator=torch.Generator().manual_seed(2))
    again = transformers_logits(out, [ids.numpy()])[0]
    assert torch.allclose(torch.as_tensor(again), their_logits(theirs, ids)[:, -1], atol=1e-5)
    assert set(hf_weights(ours)) == names


def test_fused_parameters_are_filled_from_tensors_in_different_shards(tmp_path: Path) -> None:
    """q, k and v (one fused parameter here) stored in different shards, one key/value head:
    each tensor lands in its rows of ours, whichever shard holds it."""
    saved_checkpoint(tmp_path, "llama", 3, shard_size="8KB", num_key_value_heads=1)
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())["weight_map"]
    layer = "model.layers.0.self_attn."
    assert len({index[layer + f"{x}_proj.weight"] for x in "qkv"} | {index["lm_head.weight"]}) > 1
    model = read_checkpoint(tmp_path)
    assert model.config.n_kv_heads == 1 and isinstance(model, GPT)


def write_config(folder: Path, **changes: Any) -> None:
    path = folder / "config.json"
    config = json.loads(path.read_text())
    config.update(changes)
    path.write_text(json.dumps({k: v for k, v in config.items() if v is not DROP}))


DROP = object()


@pytest.mark.parametrize(("changes", "message"), [
    ({"model_type": "gpt2"}, "model_type 'gpt2' is not supported (expected one of llama, mistral, qwen2)"),
    ({"hidden_act": "gelu"}, "hidden_act 'gelu' is not supported"),
    ({"rope_parameters": {"rope_type": "yarn", "factor": 4.0, "rope_theta": 10000.0}},
     "rope_scaling's rope_type 'yarn' is not supported"),
    ({"num_key_value_heads": 3}, "n_heads 4 is not a multiple of n_kv_heads 3"),
    ({"vocab_size": "97"}, "vocab_size is '97', expected int"),
])
def test_a_config_this_code_cannot_run_is_one_line_naming_the_field(changes: dict[str, Any], message: str,
                                                                    tmp_path: Path) -> None:
    saved_checkpoint(tmp_path, "llama")
    write_config(tmp_path, **changes)
    with pytest.raises(CheckpointError, match=r"config\.json: ") as raised:
        checkpoint_config(tmp_path)
    assert message in str(raised.value) and "\n" not in str(raised.value)


def test_mistrals_sliding_window_shorter_than_the_context_is_refused(tmp_path: Path) -> None:
    saved_checkpoint(tmp_path, "mistral")
    write_config(tmp_path, sliding_window=16)
    with pytest.raises(CheckpointError, match="sliding_window 16 is shorter than the context of 32 tokens"):
        checkpoint_config(tmp_path)
    assert checkpoint_config(tmp_path, seq_len=16).seq_len == 16  # a context within the window: fine


def test_missing_shards_tensors_and_wrong_shapes_are_one_line(tmp_path: Path) -> None:
    from safetensors.torch import load_file, save_file

    saved_checkpoint(tmp_path / "sharded", "llama", shard_size="20KB")
    shards = sorted((tmp_path / "sharded").glob("model-*.safetensors"))
    shards[-1].unlink()
    with pytest.raises(CheckpointError, match=f"shard {shards[-1].name} is missing"):
        read_checkpoint(tmp_path / "sharded")

    saved_checkpoint(tmp_path / "one", "llama")
    weights = tmp_path / "one" / "model.safetensors"
    tensors = load_file(str(weights))
    save_file({k: v for k, v in tensors.items() if k != "model.layers.1.mlp.up_proj.weight"}, str(weights))
    with pytest.raises(CheckpointError, match=r"tensor model\.layers\.1\.mlp\.up_proj\.weight is missing"):
        read_checkpoint(tmp_path / "one")
    save_file({**tensors, "model.layers.0.self_attn.k_proj.weight": torch.zeros(3, 32)}, str(weights))
    with pytest.raises(CheckpointError, match=r"k_proj.weight has shape \[3, 32\], the configuration says \[16, 32\]"):
        read_checkpoint(tmp_path / "one")
    save_file({**tensors, "model.layers.0.extra.weight": torch.zeros(1)}, str(weights))
    with pytest.raises(CheckpointError, match=r"tensor model\.layers\.0\.extra\.weight is not part of"):
        read_checkpoint(tmp_path / "one")


def special_tokenizer(add_bos_post_processor: bool = False) -> Any:
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.processors import TemplateProcessing

    vocab = {"<|begin_of_text|>": 0, "<|end_of_text|>": 1, "<|eot_id|>": 2, "a": 3, "<unk>": 4}
    tokenizer = Tokenizer(WordLevel(vocab, unk_token="<unk>"))
    if add_bos_post_processor:
        tokenizer.post_processor = TemplateProcessing(single="<|begin_of_text|> $A",
                                                      special_tokens=[("<|begin_of_text|>", 0)])
    return tokenizer


def test_a_checkpoints_special_tokens_come_from_its_configs_and_must_agree(tmp_path: Path) -> None:
    """End-of-sequence ids as generation stops (a list in generation_config.json, as Llama 3's
    instruct models), BOS added by tokenizer.json's post-processor when tokenizer_config.json does
    not say; a token whose id disagrees with tokenizer.json, or no EOS at all, is one line."""
    from tasks.lib.hf_checkpoint import checkpoint_special_tokens
    from tasks.lib.tokens import SpecialTokens

    (tmp_path / "config.json").write_text(json.dumps({"eos_token_id": 1, "bos_token_id": 0}))
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [1, 2]}))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(
        {"eos_token": {"content": "<|end_of_text|>", "special": True}, "bos_token": "<|begin_of_text|>"}))
    assert checkpoint_special_tokens(tmp_path, special_tokenizer(add_bos_post_processor=True)) == SpecialTokens(
        (1, 2), 0, None, True)
    assert checkpoint_special_tokens(tmp_path, special_tokenizer()).add_bos is False
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|eot_id|>", "add_bos_token": True}))
    (tmp_path / "generation_config.json").unlink()
    with pytest.raises(CheckpointError, match=r"eos_token '<\|eot_id\|>' is id 2 in tokenizer.json, the config says \[1\]"):
        checkpoint_special_tokens(tmp_path, special_tokenizer())
    (tmp_path / "config.json").write_text(json.dumps({"eos_token_id": 97}))
    with pytest.raises(CheckpointError, match="eos_token_id 97 is not token ids of its vocabulary of 5"):
        checkpoint_special_tokens(tmp_path, special_tokenizer())
    (tmp_path / "config.json").write_text("{}")
    (tmp_path / "tokenizer_config.json").write_text("{}")
    with pytest.raises(CheckpointError, match="no end-of-sequence token"):
        checkpoint_special_tokens(tmp_path, special_tokenizer())
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|eot_id|>"}))
    assert checkpoint_special_tokens(tmp_path, special_tokenizer()).eos_ids == (2,)
