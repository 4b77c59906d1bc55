"""Hugging Face checkpoint folders of the Llama family: read (a team's base model) and written
(every export).

Read (:func:`read_checkpoint`): ``config.json`` of a ``llama``, ``mistral`` or ``qwen2`` model and
its safetensors weights, one file or shards named by ``model.safetensors.index.json``, read one
tensor at a time into the fused layout of :class:`tasks.lib.model.GPT` (q/k/v and gate/up
stacked). Grouped-query attention, head size, untied heads, ``rope_theta`` and ``rope_scaling``
(``linear``, ``llama3``; ``rope_parameters`` as transformers 5 writes it), ``rms_norm_eps``,
Llama's ``attention_bias`` and ``mlp_bias``, Qwen2's q/k/v biases and
``max_position_embeddings`` are taken as the checkpoint says; anything else (another family, an
activation other than SiLU, sliding-window attention shorter than the context, a rope type we do
not compute) is refused with one line naming the field.

Written (:func:`write_checkpoint`): what other engines load (transformers, vLLM, TensorRT-LLM's
and ONNX Runtime GenAI's builders, llama.cpp's converter) and what load generators read the
tokenizer from (aiperf):

    config.json              LlamaForCausalLM (Qwen2ForCausalLM for q/k/v biases alone), fp32
    generation_config.json   EOS (a base's, all of them), BOS, pad; greedy by default
    model.safetensors        the weights under the family's names (q/k/v and gate/up split from
                             our fused matrices; lm_head only when it is not tied)
    tokenizer.json, tokenizer_config.json (a base's as it was: its chat template), special_tokens_map.json

Only the ``llama`` layout has this form: a gpt-v1 model (GELU MLP, interleaved rotary) is no
Llama, and :func:`write_checkpoint` refuses it.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import torch

from tasks.lib.errors import first_line
from tasks.lib.model import GPT, ROPE_SCALINGS, GPTConfig
from tasks.lib.tokens import SpecialTokens, Vocabulary

FAMILIES = ("llama", "mistral", "qwen2")  # transformers' model_type of each family read
INDEX_FILE, SINGLE_FILE = "model.safetensors.index.json", "model.safetensors"
IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)  # buffers older checkpoints saved: recomputed here


class CheckpointError(ValueError):
    """A checkpoint folder this code cannot read: one line naming the file or field."""


class NotLlama(ValueError):
    """The model's layout has no Hugging Face Llama form."""


def family_of(c: GPTConfig) -> str:
    """The Hugging Face family whose form holds ``c``: Qwen2 for biases on q/k/v alone, else Llama."""
    if c.qkv_bias and not c.out_bias and not c.mlp_bias:
        return "qwen2"
    if c.qkv_bias != c.out_bias:
        raise NotLlama("biases on the attention's output projection without q/k/v biases have no Hugging Face form")
    return "llama"


def hf_config(model: GPT, special: SpecialTokens) -> dict[str, Any]:
    c = model.config
    family = family_of(c)
    rope = {"rope_type": "default"} if c.rope_scaling is None else dict(c.rope_scaling)
    config = {
        "architectures": ["Qwen2ForCausalLM" if family == "qwen2" else "LlamaForCausalLM"],
        "model_type": family,
        "vocab_size": c.vocab_size,
        "hidden_size": c.d_model,
        "intermediate_size": c.ffn_dim,
        "num_hidden_layers": c.n_layers,
        "num_attention_heads": c.n_heads,
        "num_key_value_heads": c.n_kv_heads,
        "head_dim": c.head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": c.seq_len,
        "rms_norm_eps": c.norm_eps,
        "rope_theta": c.rope_theta,
        "rope_parameters": {**rope, "rope_theta": c.rope_theta},
        "attention_dropout": 0.0,
        "tie_word_embeddings": c.tie_embeddings,
        **special_ids(special),
        "initializer_range": 0.02,
        "use_cache": True,
        "torch_dtype": "float32",
    }
    if family == "llama":
        config |= {"attention_bias": c.qkv_bias, "mlp_bias": c.mlp_bias}
    else:
        config |= {"use_sliding_window": False, "sliding_window": None}
    return config


def weight_names(c: GPTConfig, layer: int) -> dict[str, list[str]]:
    """Per parameter of our layer ``layer``, the family's names of the tensors stacked into it (in order)."""
    ours, theirs = f"blocks.{layer}.", f"model.layers.{layer}."
    names = {ours + "norm1.weight": [theirs + "input_layernorm.weight"],
             ours + "norm2.weight": [theirs + "post_attention_layernorm.weight"],
             ours + "attn.qkv.weight": [theirs + f"self_attn.{x}_proj.weight" for x in "qkv"],
             ours + "attn.proj.weight": [theirs + "self_attn.o_proj.weight"],
             ours + "mlp.gate_up.weight": [theirs + "mlp.gate_proj.weight", theirs + "mlp.up_proj.weight"],
             ours + "mlp.down.weight": [theirs + "mlp.down_proj.weight"]}
    if c.qkv_bias:
        names[ours + "attn.qkv.bias"] = [theirs + f"self_attn.{x}_proj.bias" for x in "qkv"]
    if c.out_bias:
        names[ours + "attn.proj.bias"] = [theirs + "self_attn.o_proj.bias"]
    if c.mlp_bias:
        names[ours + "mlp.gate_up.bias"] = [theirs + "mlp.gate_proj.bias", theirs + "mlp.up_proj.bias"]
        names[ours + "mlp.down.bias"] = [theirs + "mlp.down_proj.bias"]
    return names


def all_weight_names(c: GPTConfig) -> dict[str, list[str]]:
    names = {"embed.weight": ["model.embed_tokens.weight"], "norm.weight": ["model.norm.weight"]}
    if not c.tie_embeddings:
        names["head.weight"] = ["lm_head.weight"]
    for layer in range(c.n_layers):
        names |= weight_names(c, layer)
    return names


def hf_weights(model: GPT) -> dict[str, torch.Tensor]:
    """Our state dict under the family's parameter names (contiguous copies, as safetensors wants)."""
    c = model.config
    state = model.state_dict()
    out: dict[str, torch.Tensor] = {}
    for ours, theirs in all_weight_names(c).items():
        parts = state[ours].split(split_sizes(c, ours), dim=0) if len(theirs) > 1 else (state[ours],)
        out |= dict(zip(theirs, parts, strict=True))
    return {name: tensor.detach().to(torch.float32).contiguous() for name, tensor in out.items()}


def split_sizes(c: GPTConfig, ours: str) -> list[int]:
    """The rows of each tensor stacked in our parameter ``ours`` (q/k/v or gate/up)."""
    if ".qkv." in ours:
        return [c.q_dim, c.kv_dim, c.kv_dim]
    return [c.ffn_dim, c.ffn_dim]  # gate, up


def checkpoint_config(folder: Path, seq_len: int | None = None) -> GPTConfig:
    """The architecture ``folder/config.json`` describes, as our configuration (context:
    ``seq_len``, at most the checkpoint's ``max_position_embeddings``; None: all of it)."""
    path = folder / "config.json"
    try:
        saved = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CheckpointError(f"{path}: no readable config.json ({type(exc).__name__})") from None
    if not isinstance(saved, dict):
        raise CheckpointError(f"{path}: not a JSON object")

    def field(name: str, kind: type | tuple[type, ...], default: Any = None) -> Any:
        value = saved.get(name, default)
        if not isinstance(value, kind) or (isinstance(value, bool) and kind is not bool):
            raise CheckpointError(f"{path}: {name} is {value!r}, expected {getattr(kind, '__name__', kind)}")
        return value

    family = saved.get("model_type")
    if family not in FAMILIES:
        raise CheckpointError(f"{path}: model_type {family!r} is not supported (expected one of {', '.join(FAMILIES)})")
    if saved.get("hidden_act", "silu") != "silu":
        raise CheckpointError(f"{path}: hidden_act {saved['hidden_act']!r} is not supported (expected 'silu')")
    context = field("max_position_embeddings", int)
    seq_len = min(seq_len or context, context)
    window = saved.get("sliding_window") if family == "mistral" or saved.get("use_sliding_window") else None
    if window is not None and (not isinstance(window, int) or window < seq_len):
        raise CheckpointError(f"{path}: sliding_window {window!r} is shorter than the context of {seq_len} tokens "
                              "(sliding-window attention is not supported)")
    heads = field("num_attention_heads", int)
    rope = saved.get("rope_parameters") or saved.get("rope_scaling") or {}
    if not isinstance(rope, dict):
        raise CheckpointError(f"{path}: rope_scaling is {rope!r}, expected an object")
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type != "default" and rope_type not in ROPE_SCALINGS:
        raise CheckpointError(f"{path}: rope_scaling's rope_type {rope_type!r} is not supported (expected default, "
                              f"{', '.join(ROPE_SCALINGS)})")
    theta = rope.get("rope_theta", saved.get("rope_theta", 10000.0))
    if not isinstance(theta, int | float):
        raise CheckpointError(f"{path}: rope_theta is {theta!r}, expected a number")
    scaling = None if rope_type == "default" else {"rope_type": rope_type,
                                                  **{k: rope.get(k) for k in ROPE_SCALINGS[rope_type]}}
    attention_bias = family == "llama" and field("attention_bias", bool, False)
    try:
        return GPTConfig(vocab_size=field("vocab_size", int), seq_len=seq_len, d_model=field("hidden_size", int),
                         n_layers=field("num_hidden_layers", int), n_heads=heads,
                         ffn_dim=field("intermediate_size", int), rope_theta=float(theta),
                         norm_eps=float(field("rms_norm_eps", (int, float), 1e-6)),
                         n_kv_heads=field("num_key_value_heads", int, heads),
                         head_size=field("head_dim", (int, type(None)), None) or 0,
                         tie_embeddings=field("tie_word_embeddings", bool, False),
                         qkv_bias=family == "qwen2" or attention_bias, out_bias=attention_bias,
                         mlp_bias=family == "llama" and field("mlp_bias", bool, False), rope_scaling=scaling)
    except (ValueError, TypeError) as exc:
        raise CheckpointError(f"{path}: {exc}") from None


def shard_files(folder: Path) -> dict[str, Path]:
    """Each tensor's file: the index's ``weight_map`` (shards) or the one ``model.safetensors``."""
    index = folder / INDEX_FILE
    if index.exists():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise CheckpointError(f"{index}: no readable weight_map ({type(exc).__name__})") from None
        files = {name: folder / shard for name, shard in weight_map.items()}
        missing = sorted({str(p.name) for p in files.values() if not p.exists()})
        if missing:
            raise CheckpointError(f"{index}: shard {missing[0]} is missing" + (f" (and {len(missing) - 1} more)"
                                                                               if len(missing) > 1 else ""))
        return files
    single = folder / SINGLE_FILE
    if not single.exists():
        raise CheckpointError(f"{folder}: neither {SINGLE_FILE} nor {INDEX_FILE}")
    from safetensors import safe_open

    with safe_open(str(single), "pt") as stored:
        return {name: single for name in stored.keys()}  # noqa: SIM118 (safe_open is not iterable)


def read_weights(folder: Path, c: GPTConfig) -> dict[str, torch.Tensor]:
    """Our state dict from the checkpoint's tensors, read one at a time, shard by shard, each
    copied into its place in our (fused) parameter: memory holds our model once and one of
    theirs. A tensor missing, of the wrong shape, or one we do not know: one line naming it."""
    from safetensors import SafetensorError, safe_open

    files = shard_files(folder)
    wanted = all_weight_names(c)
    place = {theirs: (ours, index) for ours, parts in wanted.items() for index, theirs in enumerate(parts)}
    unknown = sorted(n for n in files if n not in place and not n.endswith(IGNORED_SUFFIXES))
    if unknown:
        raise CheckpointError(f"{files[unknown[0]]}: tensor {unknown[0]} is not part of a {c.layout} model of this "
                              "configuration")
    absent = [n for n in place if n not in files]
    if absent:
        raise CheckpointError(f"{folder}: tensor {absent[0]} is missing" + (f" (and {len(absent) - 1} more)"
                                                                            if len(absent) > 1 else ""))
    with torch.device("meta"):
        shapes = {name: tuple(t.shape) for name, t in GPT(c).state_dict().items()}
    state = {ours: torch.empty(shapes[ours], dtype=torch.float32) for ours in wanted}
    by_file: dict[Path, list[str]] = {}
    for name, path in files.items():
        if name in place:
            by_file.setdefault(path, []).append(name)
    for path, names in by_file.items():
        try:
            with safe_open(str(path), "pt") as stored:
                for name in names:
                    ours, index = place[name]
                    target = state[ours].split(split_sizes(c, ours), dim=0)[index] if len(wanted[ours]) > 1 else state[ours]
                    tensor = stored.get_tensor(name)
                    if tuple(tensor.shape) != tuple(target.shape):
                        raise CheckpointError(f"{path.name}: tensor {name} has shape {list(tensor.shape)}, the "
                                              f"configuration says {list(target.shape)}")
                    target.copy_(tensor.to(torch.float32))
        except (SafetensorError, OSError) as exc:
            raise CheckpointError(f"{path}: unreadable ({type(exc).__name__}: {exc})") from None
    if c.tie_embeddings:
        state["head.weight"] = state["embed.weight"]
    return state


def checkpoint_tokenizer(folder: Path, embedding_rows: int) -> Any:
    """The checkpoint's ``tokenizer.json``, whose every id must have a row in the embedding
    (``embedding_rows``; more rows than tokens is padding, as Qwen2's)."""
    from tokenizers import Tokenizer

    path = folder / "tokenizer.json"
    if not path.exists():
        raise CheckpointError(f"{folder}: no tokenizer.json (a base brings its tokenizer in the fast form "
                              "transformers saves; tokenizer.model alone is not read)")
    try:
        tokenizer = Tokenizer.from_file(str(path))
    except Exception as exc:  # tokenizers raises a bare Exception on bad files
        raise CheckpointError(f"{path}: not a valid tokenizer file ({first_line(exc)})") from None
    largest = max(tokenizer.get_vocab(with_added_tokens=True).values(), default=-1)
    if largest >= embedding_rows:
        raise CheckpointError(f"{path}: token id {largest} has no row in the embedding of {embedding_rows} "
                              "(config.json vocab_size): the tokenizer is not this model's")
    return tokenizer


def checkpoint_special_tokens(folder: Path, tokenizer: Any) -> SpecialTokens:
    """A checkpoint's special tokens: end-of-sequence ids from ``generation_config.json`` (what
    generation stops at; Llama 3's instruct models list two) or ``config.json``, the BOS and pad
    ids, ``add_bos_token`` from ``tokenizer_config.json``; each token ``tokenizer_config.json``
    names must have the id the configs give it in ``tokenizer``, and every id must be in its
    vocabulary. One line naming the file and field otherwise."""
    def read(name: str) -> dict[str, Any]:
        path = folder / name
        if not path.exists():
            return {}
        try:
            found = json.loads(path.read_text())
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise CheckpointError(f"{path}: not readable JSON ({type(exc).__name__})") from None
        return found if isinstance(found, dict) else {}

    config, generation, tokenizer_config = read("config.json"), read("generation_config.json"), read(
        "tokenizer_config.json")
    vocab = tokenizer.get_vocab_size()

    def ids(name: str) -> list[int]:
        for source, values in (("generation_config.json", generation), ("config.json", config)):
            value = values.get(name)
            if value is None:
                continue
            found = value if isinstance(value, list) else [value]
            if not found or not all(isinstance(i, int) and not isinstance(i, bool) and 0 <= i < vocab for i in found):
                raise CheckpointError(f"{folder / source}: {name} {value!r} is not token ids of its vocabulary of "
                                      f"{vocab}")
            return found
        text = token_text(tokenizer_config.get(name.removesuffix("_id")))
        return [tokenizer.token_to_id(text)] if text is not None and tokenizer.token_to_id(text) is not None else []

    eos, bos, pad = ids("eos_token_id"), ids("bos_token_id"), ids("pad_token_id")
    for name, found in (("eos_token", eos), ("bos_token", bos), ("pad_token", pad)):
        text = token_text(tokenizer_config.get(name))
        if text is not None and found and tokenizer.token_to_id(text) not in found:
            raise CheckpointError(f"{folder / 'tokenizer_config.json'}: {name} {text!r} is id "
                                  f"{tokenizer.token_to_id(text)} in tokenizer.json, the config says {found}")
    if not eos:
        raise CheckpointError(f"{folder}: no end-of-sequence token (eos_token_id in generation_config.json or "
                              "config.json, or eos_token in tokenizer_config.json)")
    add_bos = tokenizer_config.get("add_bos_token")
    if not isinstance(add_bos, bool):  # unsaid (Llama 3): whether tokenizer.json's own post-processor adds it
        probe = tokenizer.encode("a", add_special_tokens=True).ids
        add_bos = bool(bos) and bool(probe) and probe[0] == bos[0]
    return SpecialTokens(tuple(eos), bos[0] if bos else None, pad[0] if pad else None, add_bos)


def token_text(value: Any) -> str | None:
    """A special token as tokenizer_config.json writes it: a string, or an AddedToken's dict (the
    engine's chat.py, copied into exports alone, keeps a copy of its own)."""
    if isinstance(value, str):
        return value
    if isinstance(value, dict) and isinstance(value.get("content"), str):
        return str(value["content"])
    return None


def read_checkpoint(folder: Path, seq_len: int | None = None) -> GPT:
    """The checkpoint in ``folder`` as our model (eval mode, fp32, CPU)."""
    config = checkpoint_config(folder, seq_len)
    model = GPT(config)
    model.load_state_dict(read_weights(folder, config), strict=True)
    return model.eval()


def write_checkpoint(model: GPT, vocabulary: Vocabulary, folder: Path) -> Path:
    """The Hugging Face folder of ``model`` with its tokenizer and special tokens (``folder`` is
    created). A base's tokenizer_config.json (its chat template) is kept as the base had it."""
    from safetensors.torch import save_file

    if model.config.layout != "llama":
        raise NotLlama(f"a {model.config.layout} model has no Hugging Face Llama form (format 1: retrain it)")
    special, tokenizer = vocabulary.special, vocabulary.tokenizer
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(hf_config(model, special), indent=1))
    (folder / "generation_config.json").write_text(json.dumps(
        {**special_ids(special), "do_sample": False, "max_length": model.config.seq_len}))
    save_file(hf_weights(model), str(folder / SINGLE_FILE), metadata={"format": "pt"})
    shutil.copy(vocabulary.file, folder / "tokenizer.json")
    texts = {"eos_token": tokenizer.id_to_token(special.eos_ids[0]),
             "bos_token": None if special.bos_id is None else tokenizer.id_to_token(special.bos_id),
             "pad_token": None if special.pad_id is None else tokenizer.id_to_token(special.pad_id)}
    specials = {k: v for k, v in texts.items() if v}
    (folder / "special_tokens_map.json").write_text(json.dumps(specials))
    tokenizer_config = vocabulary.chat_config or json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": model.config.seq_len,
        "clean_up_tokenization_spaces": False, "add_bos_token": special.add_bos, "add_eos_token": False, **specials})
    (folder / "tokenizer_config.json").write_text(tokenizer_config)
    return folder


def special_ids(special: SpecialTokens) -> dict[str, Any]:
    """The special token ids as transformers' configs name them (several EOS ids: a list)."""
    eos = special.eos_ids[0] if len(special.eos_ids) == 1 else list(special.eos_ids)
    return {"bos_token_id": special.bos_id, "eos_token_id": eos, "pad_token_id": special.pad_id}


def transformers_logits(folder: Path, batches: list[Any]) -> list[Any]:
    """Next-token logits (batch, vocab) of the checkpoint as transformers runs it, per batch of
    token ids: the export's proof that the folder is what we trained."""
    from transformers import AutoModelForCausalLM

    loaded = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32, local_files_only=True).eval()
    with torch.no_grad():
        return [loaded(torch.as_tensor(ids)).logits[:, -1, :].numpy() for ids in batches]
