"""The generation engine's decoder written with ONNX Runtime's fused operators: each layer's
attention is one ``GroupQueryAttention`` (com.microsoft) that rotates the new queries and keys,
writes the new keys and values into the cache where it lies (past and present bound to the same
buffer) and attends over each row's own length. ``decoder.onnx`` (the PyTorch export) instead
takes the batch's past as an input padded to its longest row and concatenates it with the new
positions in every layer, so each step copies every running sequence's whole past.

Inputs: ``input_ids`` (batch, new), ``seqlens_k`` (batch,) int32, each row's length after the new
tokens minus one, ``total_sequence_length`` () int32 (the longest row's length after them, or
the padded width of first prompts), and
per layer ``past_key_<i>``/``past_value_<i>`` (batch, kv_heads, context, head_dim). Outputs:
``logits`` (batch, vocab) after each row's last new token, and per layer
``present_key_<i>``/``present_value_<i>``, bound to the past's buffers. ONNX Runtime allows new
tokens after a past for one row at a time (a prefill chunk), any rows for one new token each (a
decode step), and first prompts of any rows, right-padded to the longest (a batched prefill:
``total_sequence_length`` is then the padded length, ``seqlens_k`` each row's own).

Built from the model's weights (no tracing), for the Llama layout whose head size is a multiple
of 16 (the operator's kernels); :func:`supported` says why another model is not.
"""

from __future__ import annotations

from pathlib import Path
from typing import cast

import numpy as np
import onnx
import torch
from onnx import TensorProto, helper

from tasks.lib import onnx_graphs
from tasks.lib.model import GPT, Block, SwiGLU, rope_tables
from tasks.lib.onnx_graphs import GraphBuilder
from tasks.serving.triton_models.llm_generate.engine import FusedKVDecoder

FILE = "decoder_fused.onnx"  # beside decoder.onnx in the engine's version folder (engine.FusedKVDecoder.FILE)
MS_DOMAIN = "com.microsoft"


def supported(model: GPT) -> str | None:
    """Why this model's decoder cannot be built with the fused operators, or None."""
    c = model.config
    if c.layout != "llama":
        return f"layout {c.layout} (the fused decoder is built for the Llama layout)"
    if c.head_dim % 16:
        return f"head size {c.head_dim} (ONNX Runtime's GroupQueryAttention needs a multiple of 16)"
    return None


@torch.no_grad()
def build(model: GPT, half: bool = False) -> onnx.ModelProto:
    """The fused decoder of ``model`` (see the module docstring); ``half``: weights, activations
    and cache in float16 (GroupQueryAttention's CUDA kernels take no float32; greedy text then
    differs from PyTorch's float32 now and then), logits in float32 either way. Raises
    ValueError where :func:`supported` says no."""
    reason = supported(model)
    if reason:
        raise ValueError(f"fused decoder: {reason}")
    c = model.config
    g = GraphBuilder(np.float16 if half else np.float32, contrib_ops=True)
    cache_type = TensorProto.FLOAT16 if half else TensorProto.FLOAT
    cos, sin = rope_tables(c)
    g.weight("rope_cos", cos.numpy())
    g.weight("rope_sin", sin.numpy())
    embedding = g.weight("embed.weight", model.embed.weight)
    x = g.op("Gather", [embedding, "input_ids"], "embed")[0]
    for i, block in enumerate(cast(list[Block], list(model.blocks))):
        p = f"layers.{i}"
        mlp = cast(SwiGLU, block.mlp)
        h = g.rms_norm(x, block.norm1, f"{p}.norm1")
        qkv = g.linear(h, block.attn.qkv, f"{p}.qkv")
        q, k, v = g.op("Split", [qkv, g.const([c.q_dim, c.kv_dim, c.kv_dim])], f"{p}.qkv_split", outputs=3, axis=-1)
        attended = g.op("GroupQueryAttention", [q, k, v, f"past_key_{i}", f"past_value_{i}", "seqlens_k",
                                                "total_sequence_length", "rope_cos", "rope_sin"],
                        f"{p}.attention", [f"{p}.attended", f"present_key_{i}", f"present_value_{i}"],
                        domain=MS_DOMAIN, num_heads=c.n_heads, kv_num_heads=c.n_kv_heads, do_rotary=1,
                        rotary_interleaved=0)
        x = g.op("Add", [x, g.linear(attended[0], block.attn.proj, f"{p}.proj")], f"{p}.residual1")[0]
        h = g.rms_norm(x, block.norm2, f"{p}.norm2")
        gate, up = g.op("Split", [g.linear(h, mlp.gate_up, f"{p}.gate_up")], f"{p}.gate_up_split",
                        outputs=2, axis=-1, num_outputs=2)
        silu = g.op("Mul", [gate, g.op("Sigmoid", [gate], f"{p}.sigmoid")[0]], f"{p}.silu")[0]
        down = g.linear(g.op("Mul", [silu, up], f"{p}.gated")[0], mlp.down, f"{p}.down")
        x = g.op("Add", [x, down], f"{p}.residual2")[0]
    last = g.op("GatherND", [x, last_positions(g)], "last_position", batch_dims=1)[0]  # (batch, d_model)
    normed = g.rms_norm(last, model.norm, "norm")
    head = embedding if c.tie_embeddings else g.weight("head.weight", model.head.weight)
    if half:
        g.op("Cast", [g.op("Gemm", [normed, head], "logits_half", transB=1)[0]], "logits", to=TensorProto.FLOAT)
    else:
        g.op("Gemm", [normed, head], "logits", transB=1)

    cache: list[str | int | None] = ["batch", c.n_kv_heads, c.seq_len, c.head_dim]
    inputs = [helper.make_tensor_value_info("input_ids", TensorProto.INT64, ["batch", "new"]),
              helper.make_tensor_value_info("seqlens_k", TensorProto.INT32, ["batch"]),
              helper.make_tensor_value_info("total_sequence_length", TensorProto.INT32, []),
              *(helper.make_tensor_value_info(f"past_{kind}_{i}", cache_type, cache)
                for i in range(c.n_layers) for kind in ("key", "value"))]
    outputs = [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["batch", c.vocab_size]),
               *(helper.make_tensor_value_info(f"present_{kind}_{i}", cache_type, cache)
                 for i in range(c.n_layers) for kind in ("key", "value"))]
    proto = g.model("decoder_fused", inputs, outputs, {"": 18, MS_DOMAIN: 1})
    helper.set_model_props(proto, {FusedKVDecoder.BATCHED_PREFILL: "1"})
    return proto


def last_positions(g: GraphBuilder) -> str:
    """Each row's last real new position, (batch, 1): ``min(seqlens_k, new - 1)``. That is
    ``new - 1`` for a decode step and for a later chunk of one prompt (the row's length is at
    least its new tokens), and ``seqlens_k`` for a row of a batch of first prompts right-padded
    to the longest (whose positions start at 0): several prompts prefilled in one run."""
    new = g.op("Shape", ["input_ids"], "new_count", start=1, end=2)[0]  # (1,)
    one = g.const([1])
    newest = g.op("Sub", [new, one], "newest_position")[0]
    lengths = g.op("Cast", ["seqlens_k"], "seqlens_k_int64", to=TensorProto.INT64)[0]
    row_last = g.op("Min", [lengths, newest], "row_last")[0]  # (batch,)
    return g.op("Unsqueeze", [row_last, one], "row_last_index")[0]  # (batch, 1)


def export(model: GPT, path: Path, half: bool = False) -> None:
    """``build(model, half)`` saved to ``path`` (weights inside: under 2 GB; larger beside it)."""
    onnx_graphs.save(build(model, half), path)
