"""The fused decoder (tasks/lib/decoder_graph.py) as the engine runs it (FusedKVDecoder): its
logits equal PyTorch's after a prefill, a later chunk of the same prompt, several slots' prompts
in one run and decode steps beside rows that are not decoding, for the Llama family's options (grouped-query attention, an untied
head, q/k/v biases, scaled rotary angles); what it cannot be built for is said in one line."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from helpers import cuda_provider_present

from tasks.lib import decoder_graph
from tasks.lib.model import GPT, GPTConfig
from tasks.serving.triton_models.llm_generate.engine import CacheShape, FusedKVDecoder

VOCAB, CONTEXT = 300, 40
SHAPES = {
    "gqa-untied-biases": {"n_heads": 4, "n_kv_heads": 2, "d_model": 64, "tie_embeddings": False, "qkv_bias": True},
    "mha-tied-llama3-rope": {"n_heads": 2, "d_model": 32, "rope_scaling": {
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 16}},
}


def random_model(**shape: Any) -> GPT:
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=VOCAB, seq_len=CONTEXT, n_layers=2, **shape)).eval()
    with torch.no_grad():  # biases away from zero, so that a dropped one shows
        for param in model.parameters():
            param.add_(torch.randn_like(param) * 0.02)
    return model


@torch.no_grad()
def next_logits(model: GPT, ids: list[int]) -> np.ndarray[Any, Any]:
    return model(torch.tensor([ids]))[0, -1].numpy()  # type: ignore[no-any-return]


@pytest.mark.parametrize("shape", list(SHAPES), ids=list(SHAPES))
def test_the_fused_decoder_gives_pytorchs_logits_with_its_cache_updated_in_place(tmp_path: Path, shape: str) -> None:
    model = random_model(**SHAPES[shape])
    c = model.config
    path = tmp_path / decoder_graph.FILE
    decoder_graph.export(model, path)
    decoder = FusedKVDecoder(str(path), CacheShape(c.n_layers, c.n_kv_heads, c.head_dim, c.seq_len), 4, threads=1)
    rng = np.random.default_rng(0)
    first, second = rng.integers(0, VOCAB, 9).tolist(), rng.integers(0, VOCAB, 6).tolist()
    # slot 2 prefilled in two chunks; slot 0 in one; slot 1 free (a dummy row of the decode span)
    assert np.abs(decoder.prefill(2, first[:5]) - next_logits(model, first[:5])).max() < 1e-5
    assert np.abs(decoder.prefill(2, first[5:], start=5) - next_logits(model, first)).max() < 1e-5
    assert np.abs(decoder.prefill(0, second) - next_logits(model, second)).max() < 1e-5
    sequences = {0: second, 2: first}
    pending = {slot: int(np.argmax(next_logits(model, ids))) for slot, ids in sequences.items()}
    while len(sequences[2]) < CONTEXT:  # slot 2 to the end of its context
        logits = decoder.decode([0, 2], [pending[0], pending[2]])
        for row, slot in enumerate((0, 2)):
            sequences[slot] = sequences[slot] + [pending[slot]]
            assert np.abs(logits[row] - next_logits(model, sequences[slot])).max() < 1e-5
            pending[slot] = int(np.argmax(logits[row]))
    assert decoder.lengths[[0, 2]].tolist() == [len(sequences[0]), CONTEXT]


@pytest.mark.parametrize("width", [None, 32], ids=["to-the-longest", "to-a-wider-shape"])
@pytest.mark.parametrize("shape", list(SHAPES), ids=list(SHAPES))
def test_first_prompts_of_consecutive_slots_prefill_in_one_run(tmp_path: Path, shape: str, width: int | None) -> None:
    """Three prompts of different lengths into slots 1..3 in one run (right-padded to the
    longest, or wider: a GPU's few shapes): each row's logits are PyTorch's after its own
    prompt, and decode steps after it go on as if each had been prefilled alone (the padding's
    keys, written past a row's length, are never read: the row's next tokens overwrite them)."""
    model = random_model(**SHAPES[shape])
    c = model.config
    path = tmp_path / decoder_graph.FILE
    decoder_graph.export(model, path)
    decoder = FusedKVDecoder(str(path), CacheShape(c.n_layers, c.n_kv_heads, c.head_dim, c.seq_len), 4, threads=1)
    assert decoder.batches_prefills
    rng = np.random.default_rng(1)
    prompts = [rng.integers(0, VOCAB, n).tolist() for n in (7, 12, 3)]
    logits = decoder.prefill_rows(1, prompts) if width is None else decoder.first_prompts(1, prompts, width)
    for row, ids in enumerate(prompts):
        assert np.abs(logits[row] - next_logits(model, ids)).max() < 1e-5, row
    assert decoder.lengths.tolist() == [0, 7, 12, 3]
    sequences = dict(zip((1, 2, 3), prompts, strict=True))
    for _ in range(6):
        pending = {slot: int(np.argmax(next_logits(model, ids))) for slot, ids in sequences.items()}
        logits = decoder.decode([1, 2, 3], [pending[1], pending[2], pending[3]])
        for row, slot in enumerate((1, 2, 3)):
            sequences[slot] = [*sequences[slot], pending[slot]]
            assert np.abs(logits[row] - next_logits(model, sequences[slot])).max() < 1e-5, (slot, len(sequences[slot]))


def test_what_the_fused_decoder_cannot_be_built_for_is_said_in_one_line() -> None:
    narrow = random_model(n_heads=4, d_model=32)  # heads of 8 channels
    assert decoder_graph.supported(narrow) == ("head size 8 (ONNX Runtime's GroupQueryAttention needs a multiple "
                                               "of 16)")
    with pytest.raises(ValueError, match=r"^fused decoder: head size 8 "):
        decoder_graph.build(narrow)
    assert decoder_graph.supported(random_model(n_heads=2, d_model=32)) is None


@pytest.mark.skipif(not cuda_provider_present(), reason="no GPU or no onnxruntime-gpu: run on a GPU machine "
                                                         "(docs/testing.md)")
def test_on_a_gpu_the_half_precision_fused_decoder_stays_near_pytorchs_logits(tmp_path: Path) -> None:
    """What a GPU runs (GroupQueryAttention's CUDA kernels take float16): the cache in the GPU's
    memory, each decode step replayed as a CUDA graph; logits within float16's error of
    PyTorch's float32 (not equal: greedy text may differ on near ties) after a prefill, decode
    steps beside a dummy row, and two prompts prefilled in one run."""
    from tasks.serving.triton_models.llm_generate.engine import DeviceFusedKVDecoder

    model = random_model(**SHAPES["gqa-untied-biases"])
    c = model.config
    path = tmp_path / "decoder_fused_half.onnx"
    decoder_graph.export(model, path, half=True)
    decoder = DeviceFusedKVDecoder(str(path), CacheShape(c.n_layers, c.n_kv_heads, c.head_dim, c.seq_len), 4)
    assert decoder.device.type == "cuda" and decoder.keys.dtype == torch.float16
    assert decoder.step.get_provider_options()["CUDAExecutionProvider"]["enable_cuda_graph"] == "1"
    decoder.warm(64)  # what an engine does first: each prefill shape run once, no slot left taken
    assert not decoder.lengths.any()
    ids = np.random.default_rng(0).integers(0, VOCAB, 9).tolist()
    assert np.abs(decoder.prefill(2, ids) - next_logits(model, ids)).max() < 2e-2
    for _ in range(12):
        logits = decoder.decode([2], [ids[-1]])
        ids = [*ids, ids[-1]]
        assert np.abs(logits[0] - next_logits(model, ids)).max() < 2e-2
    prompts = [ids[:5], ids[3:14]]  # two first prompts in one run, right-padded, beside slot 2
    logits = decoder.prefill_rows(0, prompts)
    for row, prompt in enumerate(prompts):
        assert np.abs(logits[row] - next_logits(model, prompt)).max() < 2e-2, row
    logits = decoder.decode([0, 1, 2], [7, 7, 7])
    for row, prompt in enumerate([*prompts, ids]):
        assert np.abs(logits[row] - next_logits(model, [*prompt, 7])).max() < 2e-2, row
