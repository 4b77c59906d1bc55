"""The trained model as a Hugging Face ``LlamaForCausalLM`` checkpoint folder.

What other engines load (transformers, vLLM, TensorRT-LLM's and ONNX Runtime GenAI's builders,
llama.cpp's converter) and what load generators read the tokenizer from (aiperf):

    config.json              LlamaForCausalLM, tied embeddings, fp32
    generation_config.json   EOS, greedy by default
    model.safetensors        the weights under Llama's names (q/k/v and gate/up split from our
                             fused matrices; no lm_head: tied to the embedding)
    tokenizer.json, tokenizer_config.json, special_tokens_map.json

Only the ``llama`` layout (format 2) has this form: a gpt-v1 model (GELU MLP, interleaved
rotary) is no Llama, and :func:`write_checkpoint` refuses it.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import torch

from tasks.lib.model import GPT
from tasks.lib.tokens import EOS, PAD


class NotLlama(ValueError):
    """The model's layout has no Hugging Face Llama form."""


def llama_config(model: GPT, eos_id: int, pad_id: int | None) -> dict[str, Any]:
    c = model.config
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": c.vocab_size,
        "hidden_size": c.d_model,
        "intermediate_size": c.ffn_dim,
        "num_hidden_layers": c.n_layers,
        "num_attention_heads": c.n_heads,
        "num_key_value_heads": c.n_heads,
        "head_dim": c.head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": c.seq_len,
        "rms_norm_eps": c.norm_eps,
        "rope_theta": c.rope_theta,
        "rope_parameters": {"rope_type": "default", "rope_theta": c.rope_theta},
        "attention_bias": False,
        "attention_dropout": 0.0,
        "mlp_bias": False,
        "tie_word_embeddings": True,
        "bos_token_id": None,
        "eos_token_id": eos_id,
        "pad_token_id": pad_id,
        "initializer_range": 0.02,
        "use_cache": True,
        "torch_dtype": "float32",
    }


def llama_weights(model: GPT) -> dict[str, torch.Tensor]:
    """Our state dict under Llama's parameter names (contiguous copies, as safetensors wants)."""
    c = model.config
    state = model.state_dict()
    out = {"model.embed_tokens.weight": state["embed.weight"], "model.norm.weight": state["norm.weight"]}
    for i in range(c.n_layers):
        ours, theirs = f"blocks.{i}.", f"model.layers.{i}."
        q, k, v = state[ours + "attn.qkv.weight"].split(c.d_model, dim=0)
        gate, up = state[ours + "mlp.gate_up.weight"].split(c.ffn_dim, dim=0)
        out |= {theirs + "input_layernorm.weight": state[ours + "norm1.weight"],
                theirs + "self_attn.q_proj.weight": q, theirs + "self_attn.k_proj.weight": k,
                theirs + "self_attn.v_proj.weight": v, theirs + "self_attn.o_proj.weight": state[ours + "attn.proj.weight"],
                theirs + "post_attention_layernorm.weight": state[ours + "norm2.weight"],
                theirs + "mlp.gate_proj.weight": gate, theirs + "mlp.up_proj.weight": up,
                theirs + "mlp.down_proj.weight": state[ours + "mlp.down.weight"]}
    return {name: tensor.detach().to(torch.float32).contiguous() for name, tensor in out.items()}


def write_checkpoint(model: GPT, tokenizer_json: Path, folder: Path) -> Path:
    """The Hugging Face folder of ``model`` with its tokenizer (``folder`` is created)."""
    from safetensors.torch import save_file
    from tokenizers import Tokenizer

    if model.config.layout != "llama":
        raise NotLlama(f"a {model.config.layout} model has no Hugging Face Llama form (format 1: retrain it)")
    tokenizer = Tokenizer.from_file(str(tokenizer_json))
    eos_id, pad_id = tokenizer.token_to_id(EOS), tokenizer.token_to_id(PAD)
    if eos_id is None:
        raise ValueError(f"{tokenizer_json}: no {EOS} token")
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(llama_config(model, eos_id, pad_id), indent=1))
    (folder / "generation_config.json").write_text(json.dumps(
        {"eos_token_id": eos_id, "pad_token_id": pad_id, "do_sample": False, "max_length": model.config.seq_len}))
    save_file(llama_weights(model), str(folder / "model.safetensors"), metadata={"format": "pt"})
    shutil.copy(tokenizer_json, folder / "tokenizer.json")
    specials = {"eos_token": EOS, "pad_token": PAD if pad_id is not None else None}
    (folder / "special_tokens_map.json").write_text(json.dumps({k: v for k, v in specials.items() if v}))
    (folder / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": model.config.seq_len,
        "clean_up_tokenization_spaces": False, "add_bos_token": False, "add_eos_token": False,
        **{k: v for k, v in specials.items() if v}}))
    return folder


def transformers_logits(folder: Path, batches: list[Any]) -> list[Any]:
    """Next-token logits (batch, vocab) of the checkpoint as transformers runs it, per batch of
    token ids: the export's proof that the folder is what we trained."""
    from transformers import LlamaForCausalLM

    loaded = LlamaForCausalLM.from_pretrained(str(folder), dtype=torch.float32, local_files_only=True).eval()
    with torch.no_grad():
        return [loaded(torch.as_tensor(ids)).logits[:, -1, :].numpy() for ids in batches]
