"""model.onnx and decoder.onnx as tasks/lib/onnx_graphs.py writes them, run by ONNX Runtime: the
logits and greedy next tokens of PyTorch's GPT (NextToken) and the logits, keys and values of
its forward_cached over ragged pasts, for every layout and option a model may have (grouped-query
attention, an untied head, biases, scaled rotary angles, a head size of its own, gpt-v1's
interleaved rotation and GELU MLP); an opset the graphs are not written for is refused."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch

from tasks.export import NextToken
from tasks.lib import onnx_graphs
from tasks.lib.model import GPT, GPTConfig
from tasks.serving.triton_models.llm_generate.engine import KVDecoder

VOCAB, CONTEXT = 300, 48
SHAPES: dict[str, dict[str, Any]] = {
    "llama": {"d_model": 64, "n_heads": 4},
    "gqa-untied-biases-linear-rope": {
        "d_model": 96, "n_heads": 6, "n_kv_heads": 2, "tie_embeddings": False, "qkv_bias": True, "out_bias": True,
        "mlp_bias": True, "norm_eps": 1e-6, "rope_scaling": {"rope_type": "linear", "factor": 2.0}},
    "one-kv-head-own-head-size-llama3-rope": {
        "d_model": 64, "n_heads": 4, "n_kv_heads": 1, "head_size": 32, "rope_theta": 500000.0, "rope_scaling": {
            "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
            "original_max_position_embeddings": 16}},
    "gpt-v1": {"d_model": 64, "n_heads": 4, "layout": "gpt-v1", "norm_eps": None, "ffn_dim": 256},
}
TOLERANCE = 1e-5


def random_model(**shape: Any) -> GPT:
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=VOCAB, seq_len=CONTEXT, n_layers=2, **shape)).eval()
    with torch.no_grad():  # every weight and bias away from its initialization, so that a dropped one shows
        for param in model.parameters():
            param.add_(torch.randn_like(param) * 0.05)
    return model


def session(proto: onnx.ModelProto, path: Path) -> ort.InferenceSession:
    onnx_graphs.save(proto, path)
    return ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])


@pytest.mark.parametrize("shape", list(SHAPES), ids=list(SHAPES))
def test_the_logits_graph_gives_pytorchs_logits_and_greedy_tokens(tmp_path: Path, shape: str) -> None:
    model = random_model(**SHAPES[shape])
    graph = session(onnx_graphs.build_logits(model, 18), tmp_path / "model.onnx")
    rng = np.random.default_rng(0)
    for batch, length in ((1, 1), (3, 17), (2, CONTEXT)):  # one token, ragged middle, the whole context
        ids = rng.integers(0, VOCAB, size=(batch, length)).astype(np.int64)
        logits, next_token = graph.run(None, {"input_ids": ids})
        with torch.no_grad():
            expected_logits, expected_next = (t.numpy() for t in NextToken(model)(torch.from_numpy(ids)))
        assert np.abs(logits - expected_logits).max() < TOLERANCE, (batch, length)
        assert next_token.shape == (batch, 1) and np.array_equal(next_token, expected_next)


@pytest.mark.parametrize("shape", list(SHAPES), ids=list(SHAPES))
def test_the_decoder_graph_gives_forward_cacheds_logits_keys_and_values(tmp_path: Path, shape: str) -> None:
    model = random_model(**SHAPES[shape])
    c = model.config
    graph = session(onnx_graphs.build_decoder(model, 18), tmp_path / "decoder.onnx")
    rng = np.random.default_rng(0)
    # rows of one batch with pasts of their own lengths (the rest padding, which must not count),
    # prefills behind a one-slot masked past, and a decode step
    for lengths, new in (([3, 10, 1], 4), ([0, 0], 5), ([7, 2], 1)):
        past = max(max(lengths), 1)
        keys = torch.randn(c.n_layers, len(lengths), c.n_kv_heads, past, c.head_dim)
        values = torch.randn_like(keys)
        ids = torch.from_numpy(rng.integers(0, VOCAB, size=(len(lengths), new)).astype(np.int64))
        past_lengths = torch.tensor(lengths)
        with torch.no_grad():
            expected = [t.numpy() for t in model.forward_cached(ids, keys, values, past_lengths)]
        feed = dict(zip(KVDecoder.INPUTS, (ids.numpy(), keys.numpy(), values.numpy(), past_lengths.numpy()), strict=True))
        got = graph.run(list(KVDecoder.OUTPUTS), feed)
        for name, ours, theirs in zip(KVDecoder.OUTPUTS, got, expected, strict=True):
            assert ours.shape == theirs.shape and np.abs(ours - theirs).max() < TOLERANCE, (name, lengths, new)


def test_an_opset_before_the_graphs_operators_is_refused() -> None:
    with pytest.raises(ValueError, match="opset 17: the graphs are written for opset 18 or later"):
        onnx_graphs.build_logits(random_model(**SHAPES["llama"]), 17)
