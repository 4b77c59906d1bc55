"""A tiny Hugging Face base checkpoint, built offline: a byte-level BPE trained on your text and
a randomly initialized model of the Llama family, saved as transformers saves any checkpoint.

    .venvs/runtime/bin/python -m examples.tiny_base --family llama --text "docs/*.md" --out /tmp/tiny-llama

``llama``: grouped-query attention, an untied head, Llama 3's special tokens (a BOS its
tokenizer adds, two end-of-sequence tokens) and chat template. ``qwen2``: q/k/v biases, an
embedding padded past the tokenizer, no BOS, ChatML. What docs/tutorial.md brings as "your
model", and what the tests retrain; a real base (Llama 3.2 1B, Qwen2.5 0.5B) is a folder of the
same files (config.json, safetensors, tokenizer.json, tokenizer_config.json,
generation_config.json), downloaded beforehand.
"""

from __future__ import annotations

import argparse
import glob
import json
from collections.abc import Iterable
from pathlib import Path
from typing import Any

FAMILIES = ("llama", "qwen2")
# the special tokens of each family, as its real checkpoints name them
LLAMA_SPECIALS = ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]
QWEN_SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
LLAMA_TEMPLATE = (
    "{{- bos_token }}"
    "{%- for message in messages %}"
    "{{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' + message['content'] | trim + '<|eot_id|>' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{%- endif %}"
)
QWEN_TEMPLATE = (
    "{%- for message in messages %}"
    "{%- if loop.first and message['role'] != 'system' %}"
    "{{- '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}{%- endif %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


def train_tokenizer(texts: Iterable[str], vocab_size: int, specials: list[str], bos: str | None) -> Any:
    """A byte-level BPE (the form of Llama 3's and Qwen2's tokenizers); ``bos``: added in front of
    every encoding by the tokenizer's own post-processor, as Llama 3's is."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=specials, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator(texts, trainer=trainer)
    if bos is not None:
        tokenizer.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, tokenizer.token_to_id(bos))])
    return tokenizer


def make_base(family: str, texts: Iterable[str], out: Path, vocab_size: int = 512, seed: int = 0,
              shard_size: str | None = None, shape: dict[str, Any] | None = None, dtype: str = "float32") -> Path:
    """The checkpoint folder ``out`` (created): tokenizer trained on ``texts``, random weights.
    ``shape`` overrides the tiny default's config fields (a model's size: benchmarks/base_memory.py
    builds a Llama 3.2 1B's); ``dtype``: the weights' type in the safetensors files."""
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config

    if family not in FAMILIES:
        raise ValueError(f"family {family!r}: expected one of {', '.join(FAMILIES)}")
    llama = family == "llama"
    specials = LLAMA_SPECIALS if llama else QWEN_SPECIALS
    tokenizer = train_tokenizer(texts, vocab_size, specials, "<|begin_of_text|>" if llama else None)
    ids = {token: tokenizer.token_to_id(token) for token in specials}
    fields: dict[str, Any] = {"hidden_size": 64, "intermediate_size": 160, "num_hidden_layers": 2, "num_attention_heads": 4,
             "num_key_value_heads": 2, "max_position_embeddings": 256, "rms_norm_eps": 1e-5,
             "tie_word_embeddings": False} | (shape or {})
    if llama:
        eos = [ids["<|end_of_text|>"], ids["<|eot_id|>"]]
        fields = {"vocab_size": tokenizer.get_vocab_size(),
                  "rope_parameters": {"rope_type": "default", "rope_theta": 500000.0}} | fields
        config: Any = LlamaConfig(bos_token_id=ids["<|begin_of_text|>"], eos_token_id=eos, **fields)
        tokenizer_config: dict[str, Any] = {"bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>", "chat_template": LLAMA_TEMPLATE}
        generation: dict[str, Any] = {"bos_token_id": ids["<|begin_of_text|>"], "eos_token_id": eos}
    else:
        eos = [ids["<|endoftext|>"], ids["<|im_end|>"]]
        fields = {"vocab_size": tokenizer.get_vocab_size() + 32} | fields  # padded past the tokenizer, as Qwen2's is
        config = Qwen2Config(eos_token_id=eos[0], use_sliding_window=False, **fields)
        tokenizer_config = {"bos_token": None, "eos_token": "<|endoftext|>", "pad_token": "<|endoftext|>",
                            "add_bos_token": False, "chat_template": QWEN_TEMPLATE}
        generation = {"bos_token_id": None, "eos_token_id": eos, "pad_token_id": ids["<|endoftext|>"]}
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config).to(getattr(torch, dtype))
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(out), **({"max_shard_size": shard_size} if shard_size else {}))
    tokenizer.save(str(out / "tokenizer.json"))
    tokenizer_config |= {"tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": config.max_position_embeddings,
                         "clean_up_tokenization_spaces": False}
    (out / "tokenizer_config.json").write_text(json.dumps(tokenizer_config, indent=1))
    (out / "generation_config.json").write_text(json.dumps({**generation, "do_sample": False}, indent=1))
    return out


def read_texts(pattern: str) -> list[str]:
    """The text of every file ``pattern`` matches (a glob; JSON Lines: each record's ``text``)."""
    texts: list[str] = []
    for name in sorted(glob.glob(pattern, recursive=True)):
        content = Path(name).read_text(encoding="utf-8", errors="replace")
        if name.endswith(".jsonl"):
            texts.extend(json.loads(line)["text"] for line in content.splitlines() if line.strip())
        else:
            texts.append(content)
    if not texts:
        raise SystemExit(f"--text {pattern!r}: no file matches")
    return texts


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--family", choices=FAMILIES, default="llama")
    p.add_argument("--text", required=True, help="a glob of the text files the tokenizer learns from")
    p.add_argument("--out", required=True, type=Path, help="the checkpoint folder to write")
    p.add_argument("--vocab-size", type=int, default=512)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    folder = make_base(args.family, read_texts(args.text), args.out, args.vocab_size, args.seed)
    print(f"{args.family} checkpoint written to {folder}")


if __name__ == "__main__":
    main()
