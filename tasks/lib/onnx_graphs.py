"""``model.onnx`` and ``decoder.onnx`` written from a model's weights with standard ONNX operators
(opset 18 and later: what ONNX Runtime on any provider, Triton's onnxruntime backend and
TensorRT's parser all read), no tracing. torch.onnx's dynamo exporter traced the same
computation with symbolic shapes: 11 s a graph for the 0.9M-parameter preset on a CPU core,
where writing it takes milliseconds. The export checks both against PyTorch on every export
(``tasks/export.py``), so a graph here that drifted from :class:`GPT` fails there in one line.

``model.onnx``: ``input_ids`` (batch, seq) -> ``logits`` (batch, vocab) after the last position
and ``next_token`` (batch, 1), its greedy choice (:class:`tasks.export.NextToken`).

``decoder.onnx``: :meth:`GPT.forward_cached`: ``input_ids`` (batch, new) after ``past_keys`` /
``past_values`` (layers, batch, kv_heads, past, head_dim) of which each row holds its first
``past_lengths`` positions -> ``logits`` (batch, vocab) after the last new token and the new
positions' keys and values ``present_keys`` / ``present_values`` (layers, batch, kv_heads, new,
head_dim).

Attention keeps the key/value heads as they are: the queries are grouped (batch, kv_heads,
group, time, head_dim) and broadcast against them, so grouped-query attention repeats no cache.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import numpy as np
import onnx
import torch
from onnx import TensorProto, helper, numpy_helper

from tasks.config.serving import MIN_OPSET
from tasks.lib.model import GPT, Block, GeluMLP, SwiGLU, rope_tables

IR_VERSION = 10  # what ONNX Runtime 1.31 reads (onnx 1.19 writes 11)
LOGITS_OUTPUTS = ("logits", "next_token")  # decoder.onnx's names are the engine's (KVDecoder.INPUTS, OUTPUTS)


class GraphBuilder:
    """Nodes and initializers of one graph, named as they are added; weights in ``dtype``.
    ``contrib_ops``: RMS norms as ONNX Runtime's SimplifiedLayerNormalization (the fused
    decoder's), else in standard operators."""

    def __init__(self, dtype: type[np.floating[Any]] = np.float32, contrib_ops: bool = False) -> None:
        self.nodes: list[onnx.NodeProto] = []
        self.initializers: list[onnx.TensorProto] = []
        self.dtype = dtype
        self.contrib_ops = contrib_ops
        self.constants: dict[tuple[str, bytes], str] = {}

    def weight(self, name: str, tensor: torch.Tensor | np.ndarray[Any, Any]) -> str:
        array = tensor.detach().float().numpy() if isinstance(tensor, torch.Tensor) else tensor
        self.initializers.append(numpy_helper.from_array(np.ascontiguousarray(array, self.dtype), name))
        return name

    def const(self, value: Any, dtype: type[np.generic] = np.int64) -> str:
        """A constant (scalar or list) of ``dtype``, one initializer per distinct value."""
        array = np.asarray(value, dtype)
        key = (array.dtype.str + str(array.shape), array.tobytes())
        if key not in self.constants:
            name = f"const_{len(self.constants)}"
            self.initializers.append(numpy_helper.from_array(array, name))
            self.constants[key] = name
        return self.constants[key]

    def op(self, kind: str, inputs: list[str], name: str, outputs: int | list[str] = 1, domain: str = "",
           **attrs: Any) -> list[str]:
        """Adds the node; returns its outputs' names (``outputs``: how many, or their names)."""
        names = (outputs if isinstance(outputs, list)
                 else [name] if outputs == 1 else [f"{name}_{i}" for i in range(outputs)])
        self.nodes.append(helper.make_node(kind, inputs, names, name=name, domain=domain, **attrs))
        return names

    def one(self, kind: str, inputs: list[str], name: str, **attrs: Any) -> str:
        """:meth:`op` of a node with one output: its name."""
        return self.op(kind, inputs, name, **attrs)[0]

    def linear(self, x: str, layer: torch.nn.Linear, name: str) -> str:
        """x @ W^T (+ b): the weight stored transposed, as MatMul wants it."""
        out = self.one("MatMul", [x, self.weight(f"{name}.weight_t", layer.weight.detach().float().T)], f"{name}.matmul")
        if layer.bias is not None:
            out = self.one("Add", [out, self.weight(f"{name}.bias", layer.bias)], f"{name}.add")
        return out

    def rms_norm(self, x: str, norm: torch.nn.RMSNorm, name: str) -> str:
        """x / sqrt(mean(x^2) + eps) * weight, as torch's RMSNorm computes it."""
        eps = float(norm.eps if norm.eps is not None else torch.finfo(torch.float32).eps)
        weight = self.weight(f"{name}.weight", norm.weight)
        if self.contrib_ops:
            return self.one("SimplifiedLayerNormalization", [x, weight], name, axis=-1, epsilon=eps, stash_type=1)
        mean = self.one("ReduceMean", [self.one("Mul", [x, x], f"{name}.square"), self.const([-1])], f"{name}.mean",
                        keepdims=1)
        root = self.one("Sqrt", [self.one("Add", [mean, self.const(eps, np.float32)], f"{name}.eps")], f"{name}.sqrt")
        scaled = self.one("Mul", [x, self.one("Reciprocal", [root], f"{name}.inverse")], f"{name}.scaled")
        return self.one("Mul", [scaled, weight], name)

    def shape_part(self, tensor: str, start: int, name: str) -> str:
        """Dimension ``start`` of ``tensor``'s shape, as a 1-element int64 tensor."""
        return self.one("Shape", [tensor], name, start=start, end=start + 1)

    def model(self, name: str, inputs: list[onnx.ValueInfoProto], outputs: list[onnx.ValueInfoProto],
              opsets: dict[str, int]) -> onnx.ModelProto:
        graph = helper.make_graph(self.nodes, name, inputs, outputs, self.initializers)
        return helper.make_model(graph, ir_version=IR_VERSION, producer_name="llm-pipeline",
                                 opset_imports=[helper.make_opsetid(domain, v) for domain, v in opsets.items()])


def rotate(g: GraphBuilder, x: str, rope: tuple[str, str], interleaved: bool, shape: tuple[int, int],
           name: str) -> str:
    """:func:`tasks.lib.model.apply_rope` on ``x`` of ``shape`` (rank, head_dim), whose last
    axes are time and head_dim; ``rope``: cos and sin, broadcast to (..., time, head_dim / 2)."""
    cos, sin = rope
    rank, head_dim = shape
    if interleaved:  # gpt-v1: the pairs (x[2i], x[2i+1]), as (..., head_dim / 2, 2)
        paired = g.one("Reshape", [x, g.const([0] * (rank - 1) + [head_dim // 2, 2])], f"{name}.pairs")
        x1, x2 = (g.one("Squeeze", [half, g.const([-1])], f"{name}.half{i}")
                  for i, half in enumerate(g.op("Split", [paired], f"{name}.split", outputs=2, axis=-1, num_outputs=2)))
    else:  # Llama: the first half of the channels against the second
        x1, x2 = g.op("Split", [x], f"{name}.halves", outputs=2, axis=-1, num_outputs=2)
    first = g.one("Sub", [g.one("Mul", [x1, cos], f"{name}.x1cos"), g.one("Mul", [x2, sin], f"{name}.x2sin")],
                  f"{name}.first")
    second = g.one("Add", [g.one("Mul", [x2, cos], f"{name}.x2cos"), g.one("Mul", [x1, sin], f"{name}.x1sin")],
                   f"{name}.second")
    if not interleaved:
        return g.one("Concat", [first, second], name, axis=-1)
    stacked = g.one("Concat", [g.one("Unsqueeze", [first, g.const([-1])], f"{name}.first1"),
                               g.one("Unsqueeze", [second, g.const([-1])], f"{name}.second1")], f"{name}.stacked", axis=-1)
    return g.one("Reshape", [stacked, g.const([0] * (rank - 1) + [head_dim])], name)


@dataclass(frozen=True)
class Positions:
    """Where this run's new tokens stand: cos and sin of their angles, shaped for the grouped
    queries (5 axes) and for the keys (4 axes), and the additive mask of what each sees,
    broadcast to the scores (batch, kv_heads, group, new, past + new)."""

    queries: tuple[str, str]
    keys: tuple[str, str]
    mask: str


def attention(g: GraphBuilder, block: Block, h: str, at: Positions, past: tuple[str, str] | None,
              name: str) -> tuple[str, str, str]:
    """The block's attention over ``h`` (batch, new, d_model) after ``past`` keys and values
    (batch, kv_heads, past, head_dim; none: the new positions alone). Returns the projected
    output and the new positions' keys and values (batch, kv_heads, new, head_dim), keys rotated."""
    attn = block.attn
    kv_heads, head_dim = attn.n_kv_heads, attn.head_size
    group = attn.n_heads // kv_heads
    q_dim, kv_dim = attn.n_heads * head_dim, kv_heads * head_dim
    interleaved = attn.interleaved
    q, k, v = g.op("Split", [g.linear(h, attn.qkv, f"{name}.qkv"), g.const([q_dim, kv_dim, kv_dim])],
                   f"{name}.qkv_split", outputs=3, axis=-1)
    # queries (batch, kv_heads, group, new, head_dim): query head j * group + i reads key head j,
    # as transformers' repeat_kv pairs them
    q = g.one("Transpose", [g.one("Reshape", [q, g.const([0, 0, kv_heads, group, head_dim])], f"{name}.q_heads")],
              f"{name}.q_grouped", perm=[0, 2, 3, 1, 4])
    q = rotate(g, q, at.queries, interleaved, (5, head_dim), f"{name}.q")
    k, v = (g.one("Transpose", [g.one("Reshape", [t, g.const([0, 0, kv_heads, head_dim])], f"{name}.{n}_heads")],
                  f"{name}.{n}_t", perm=[0, 2, 1, 3]) for n, t in (("k", k), ("v", v)))
    k = rotate(g, k, at.keys, interleaved, (4, head_dim), f"{name}.k")
    keys, values = k, v
    if past is not None:
        keys = g.one("Concat", [past[0], k], f"{name}.keys", axis=2)
        values = g.one("Concat", [past[1], v], f"{name}.values", axis=2)
    keys_t = g.one("Unsqueeze", [g.one("Transpose", [keys], f"{name}.keys_t", perm=[0, 1, 3, 2]), g.const([2])],
                   f"{name}.keys_grouped")
    scores = g.one("MatMul", [g.one("Mul", [q, g.const(1 / math.sqrt(head_dim), np.float32)], f"{name}.q_scaled"),
                              keys_t], f"{name}.scores")
    probs = g.one("Softmax", [g.one("Add", [scores, at.mask], f"{name}.masked")], f"{name}.probs", axis=-1)
    out = g.one("MatMul", [probs, g.one("Unsqueeze", [values, g.const([2])], f"{name}.values_grouped")], f"{name}.out")
    merged = g.one("Reshape", [g.one("Transpose", [out], f"{name}.out_t", perm=[0, 3, 1, 2, 4]), g.const([0, 0, q_dim])],
                   f"{name}.merged")
    return g.linear(merged, attn.proj, f"{name}.proj"), k, v


def mlp(g: GraphBuilder, block: Block, h: str, name: str) -> str:
    """SwiGLU (Llama), or gpt-v1's tanh-approximated GELU MLP."""
    if isinstance(block.mlp, GeluMLP):
        x = g.linear(h, block.mlp.up, f"{name}.up")
        cubic = g.one("Mul", [g.one("Mul", [g.one("Mul", [x, x], f"{name}.x2"), x], f"{name}.x3"),
                              g.const(0.044715, np.float32)], f"{name}.cubic")
        inner = g.one("Mul", [g.one("Add", [x, cubic], f"{name}.sum"), g.const(math.sqrt(2 / math.pi), np.float32)],
                      f"{name}.inner")
        half = g.one("Mul", [x, g.const(0.5, np.float32)], f"{name}.half")
        gelu = g.one("Mul", [half, g.one("Add", [g.one("Tanh", [inner], f"{name}.tanh"), g.const(1.0, np.float32)],
                                         f"{name}.one_plus")], f"{name}.gelu")
        return g.linear(gelu, block.mlp.down, f"{name}.down")
    swiglu = cast(SwiGLU, block.mlp)
    gate, up = g.op("Split", [g.linear(h, swiglu.gate_up, f"{name}.gate_up")], f"{name}.gate_up_split",
                    outputs=2, axis=-1, num_outputs=2)
    silu = g.one("Mul", [gate, g.one("Sigmoid", [gate], f"{name}.sigmoid")], f"{name}.silu")
    return g.linear(g.one("Mul", [silu, up], f"{name}.gated"), swiglu.down, f"{name}.down")


def blocks(g: GraphBuilder, model: GPT, at: Positions, pasts: list[tuple[str, str]] | None
           ) -> tuple[str, list[str], list[str]]:
    """Every block over the embedded ``input_ids``: the last block's output (batch, new,
    d_model) and each layer's new keys and values."""
    x = g.one("Gather", [g.weight("embed.weight", model.embed.weight), "input_ids"], "embed")
    keys, values = [], []
    for i, block in enumerate(cast(list[Block], list(model.blocks))):
        p = f"layers.{i}"
        attended, k, v = attention(g, block, g.rms_norm(x, block.norm1, f"{p}.norm1"), at,
                                   None if pasts is None else pasts[i], f"{p}.attn")
        x = g.one("Add", [x, attended], f"{p}.residual1")
        x = g.one("Add", [x, mlp(g, block, g.rms_norm(x, block.norm2, f"{p}.norm2"), f"{p}.mlp")], f"{p}.residual2")
        keys.append(k)
        values.append(v)
    return x, keys, values


def last_logits(g: GraphBuilder, model: GPT, x: str, new: str) -> str:
    """The logits (batch, vocab) after the last of ``new`` positions of ``x`` (batch, new,
    d_model): the final norm and the head on that position alone. (Its index is computed, not
    -1: TensorRT's Gather takes no negative index.)"""
    last_index = g.one("Squeeze", [g.one("Sub", [new, g.const([1])], "last_index1"), g.const([0])], "last_index")
    last = g.one("Gather", [x, last_index], "last_position", axis=1)
    normed = g.rms_norm(last, model.norm, "norm")
    head = "embed.weight" if model.config.tie_embeddings else g.weight("head.weight", model.head.weight)
    return g.one("Gemm", [normed, head], "logits", transB=1)


def causal(g: GraphBuilder, steps: str) -> str:
    """(new, new) booleans: position i sees position j where j <= i."""
    return g.one("LessOrEqual", [g.one("Unsqueeze", [steps, g.const([0])], "steps_row"),
                                 g.one("Unsqueeze", [steps, g.const([1])], "steps_column")], "causal")


def additive(g: GraphBuilder, seen: str, name: str) -> str:
    """0 where ``seen``, -inf elsewhere: added to the attention scores."""
    return g.one("Where", [seen, g.const(0.0, np.float32), g.const(-np.inf, np.float32)], name)


def check_opset(opset: int) -> None:
    if opset < MIN_OPSET:
        raise ValueError(f"opset {opset}: the graphs are written for opset {MIN_OPSET} or later")


def counted(g: GraphBuilder, tensor: str, axis: int, name: str) -> tuple[str, str]:
    """Dimension ``axis`` of ``tensor`` (a 1-element tensor) and the positions 0 .. it - 1."""
    count = g.shape_part(tensor, axis, f"{name}_count")
    scalar = g.one("Squeeze", [count, g.const([0])], f"{name}_scalar")
    return count, g.one("Range", [g.const(0), scalar, g.const(1)], f"{name}_steps")


def rope_weights(g: GraphBuilder, model: GPT) -> list[tuple[str, str]]:
    """The rotary tables (context, head_dim / 2) as initializers: (kind, name) for cos and sin."""
    return [(kind, g.weight(f"rope_{kind}", table.numpy())) for kind, table in zip(("cos", "sin"),
                                                                                 rope_tables(model.config), strict=True)]


@torch.no_grad()
def build_logits(model: GPT, opset: int) -> onnx.ModelProto:
    """``model.onnx`` (see the module docstring)."""
    check_opset(opset)
    g = GraphBuilder()
    new, steps = counted(g, "input_ids", 1, "new")
    tables = [g.one("Slice", [table, g.const([0]), new, g.const([0])], f"rope_{kind}_positions")
              for kind, table in rope_weights(g, model)]  # positions 0 .. new - 1: (new, head_dim / 2)
    at = Positions((tables[0], tables[1]), (tables[0], tables[1]), additive(g, causal(g, steps), "mask"))
    x, _, _ = blocks(g, model, at, None)
    logits = last_logits(g, model, x, new)
    g.op("ArgMax", [logits], "next_token", axis=-1, keepdims=1)
    inputs = [helper.make_tensor_value_info("input_ids", TensorProto.INT64, ["batch", "seq"])]
    outputs = [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["batch", model.config.vocab_size]),
               helper.make_tensor_value_info("next_token", TensorProto.INT64, ["batch", 1])]
    return g.model("next_token", inputs, outputs, {"": opset})


@torch.no_grad()
def build_decoder(model: GPT, opset: int) -> onnx.ModelProto:
    """``decoder.onnx`` (see the module docstring)."""
    check_opset(opset)
    c = model.config
    g = GraphBuilder()
    batch = g.shape_part("input_ids", 0, "batch_count")
    (new, steps), (past, past_steps) = counted(g, "input_ids", 1, "new"), counted(g, "past_keys", 3, "past")
    lengths = g.one("Unsqueeze", ["past_lengths", g.const([1])], "lengths_column")  # (batch, 1)
    positions = g.one("Add", [lengths, g.one("Unsqueeze", [steps, g.const([0])], "steps_row0")], "positions")
    queries, keys = [], []
    for kind, table in rope_weights(g, model):  # each row's positions: (batch, new, head_dim / 2)
        rows = g.one("Gather", [table, positions], f"rope_{kind}_positions", axis=0)
        keys.append(g.one("Unsqueeze", [rows, g.const([1])], f"rope_{kind}_keys"))
        queries.append(g.one("Unsqueeze", [rows, g.const([1, 2])], f"rope_{kind}_queries"))
    # what each new position sees: its row's past (the first past_lengths slots), then the new
    # positions up to itself; (batch, 1, 1, new, past + new)
    seen_past = g.one("Less", [g.one("Unsqueeze", [past_steps, g.const([0])], "past_row"), lengths], "seen_past")
    past_mask = g.one("Expand", [g.one("Unsqueeze", [additive(g, seen_past, "past_additive"), g.const([1])],
                                       "past_rows"),
                                 g.one("Concat", [batch, new, past], "past_mask_shape", axis=0)], "past_mask")
    new_mask = g.one("Expand", [g.one("Unsqueeze", [additive(g, causal(g, steps), "causal_additive"), g.const([0])],
                                      "causal_rows"),
                                g.one("Concat", [batch, new, new], "new_mask_shape", axis=0)], "new_mask")
    mask = g.one("Unsqueeze", [g.one("Concat", [past_mask, new_mask], "mask_rows", axis=2), g.const([1, 2])], "mask")
    pasts = [(g.one("Gather", ["past_keys", g.const(i)], f"past_key_{i}", axis=0),
              g.one("Gather", ["past_values", g.const(i)], f"past_value_{i}", axis=0)) for i in range(c.n_layers)]
    at = Positions((queries[0], queries[1]), (keys[0], keys[1]), mask)
    x, new_keys, new_values = blocks(g, model, at, pasts)
    last_logits(g, model, x, new)
    for output, layers in (("present_keys", new_keys), ("present_values", new_values)):
        g.op("Concat", [g.one("Unsqueeze", [t, g.const([0])], f"{output}_{i}") for i, t in enumerate(layers)],
             output, outputs=[output], axis=0)
    cache: list[str | int | None] = [c.n_layers, "batch", c.n_kv_heads, "past", c.head_dim]
    present: list[str | int | None] = [c.n_layers, "batch", c.n_kv_heads, "new", c.head_dim]
    inputs = [helper.make_tensor_value_info("input_ids", TensorProto.INT64, ["batch", "new"]),
              helper.make_tensor_value_info("past_keys", TensorProto.FLOAT, cache),
              helper.make_tensor_value_info("past_values", TensorProto.FLOAT, cache),
              helper.make_tensor_value_info("past_lengths", TensorProto.INT64, ["batch"])]
    outputs = [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["batch", c.vocab_size]),
               helper.make_tensor_value_info("present_keys", TensorProto.FLOAT, present),
               helper.make_tensor_value_info("present_values", TensorProto.FLOAT, present)]
    return g.model("decoder", inputs, outputs, {"": opset})


def save(proto: onnx.ModelProto, path: Path) -> None:
    """``proto`` saved to ``path``, weights inside under 2 GB (protobuf's limit), else beside it
    in ``<name>.data`` (:func:`data_file`)."""
    large = proto.ByteSize() > 2**31 - 2**20
    onnx.save_model(proto, str(path), save_as_external_data=large, location=data_file(path).name)


def data_file(path: Path) -> Path:
    """Where :func:`save` puts the weights of a graph over 2 GB: copied with it."""
    return path.with_name(f"{path.name}.data")
