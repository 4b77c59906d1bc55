"""The generation engine in-process (unit): a tiny model exported to decoder.onnx, the real
engine file the Triton model runs, a real tokenizer. Triton and the router: test_serving.py."""

from __future__ import annotations

import itertools
import threading
import time
from pathlib import Path
from typing import Any, cast

import numpy as np
import pytest
import torch
from helpers import cuda_provider_present

from tasks.lib import tokens
from tasks.lib.model import GPT, GPTConfig, generate_greedy
from tasks.serving.triton_models.llm_generate.engine import (  # the file Triton loads beside model.py
    CacheShape,
    Detokenizer,
    DeviceFusedKVDecoder,
    DeviceKVDecoder,
    Engine,
    EngineLimits,
    FusedKVDecoder,
    GraphKVDecoder,
    KVDecoder,
    Outbox,
    Overloaded,
    RequestError,
    SamplingRequest,
    Sequence,
    check_sampling,
    generate,
    tensorrt_runtime_present,
)

TEXTS = [f"Return the number of items in bucket {i}; raise ValueError if it is empty. café {i % 7}" for i in range(300)]
CONTEXT = 48


# every decoder on this machine's provider; the fused one bound by address only off a GPU (there
# its GroupQueryAttention needs float16: tests/tasks/test_decoder_graph.py's GPU test)
DECODER_KINDS = [KVDecoder, DeviceKVDecoder, GraphKVDecoder, FusedKVDecoder,
                 pytest.param(DeviceFusedKVDecoder, marks=pytest.mark.skipif(
                     cuda_provider_present(), reason="on a GPU the fused decoder runs in float16"))]


@pytest.fixture(scope="module")
def exported(tmp_path_factory: pytest.TempPathFactory) -> tuple[GPT, Any, Path]:
    from tasks.export import export_decoder
    from tasks.lib import decoder_graph

    tokenizer = tokens.train_tokenizer(TEXTS, 400)
    torch.manual_seed(0)
    # heads of 16 channels: the fused decoder's GroupQueryAttention takes multiples of 16
    model = GPT(GPTConfig(vocab_size=tokenizer.get_vocab_size(), seq_len=CONTEXT, d_model=32, n_layers=2,
                          n_heads=2)).eval()
    path = tmp_path_factory.mktemp("engine") / "decoder.onnx"
    export_decoder(model, path, 18)
    decoder_graph.export(model, path.with_name(FusedKVDecoder.FILE))
    return model, tokenizer, path


def engine_of(exported: tuple[GPT, Any, Path], slots: int = 4, queue: int = 8, timeout_s: float = 30.0,
              decoder_kind: type[KVDecoder] = KVDecoder, prefill_tokens: int = 0) -> Engine:
    model, tokenizer, path = exported
    c = model.config
    onnx = path.with_name(FusedKVDecoder.FILE) if issubclass(decoder_kind, FusedKVDecoder) else path
    decoder = decoder_kind(str(onnx), CacheShape(c.n_layers, c.n_kv_heads, c.head_dim, c.seq_len), slots, threads=1)
    limits = EngineLimits(slots, queue, 8, timeout_s, prefill_tokens=prefill_tokens)
    return Engine(decoder, tokenizer, c.seq_len, limits).start()


def staggered(engine: Engine, prompts: list[list[int]], max_tokens: list[int], every_s: float,
              timeout_s: float = 60.0) -> list[Sequence]:
    """Greedy requests submitted ``every_s`` apart (later ones join a batch already decoding),
    each on a thread of its own, as a server's clients; the engine is stopped after them."""
    results: list[Sequence | None] = [None] * len(prompts)

    def run(index: int) -> None:
        time.sleep(every_s * index)
        ids = prompts[index]
        results[index] = generate(engine, ids, check_sampling(SamplingRequest(max_tokens[index]), 8, len(ids), engine.context),
                                  timeout_s=timeout_s)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(prompts))]
    try:
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout_s + every_s * len(prompts))
    finally:
        engine.stop()
    assert all(results), results
    return [r for r in results if r is not None]


def prompt_ids(tokenizer: Any, text: str) -> list[int]:
    ids: list[int] = tokenizer.encode(text, add_special_tokens=False).ids
    return ids


@pytest.mark.parametrize("decoder_kind", DECODER_KINDS, ids=["host-cache", "bound-cache", "fixed-shape-step",
                                                         "fused-in-place", "fused-bound"])
def test_requests_joining_a_running_batch_get_the_reference_continuations(exported: tuple[GPT, Any, Path],
                                                                          decoder_kind: type[KVDecoder]) -> None:
    """Six requests of different prompts, submitted while others run, on four slots: each
    greedy continuation equals PyTorch's (KV cache, batch 1) token for token. Both caches: the
    host's, and the one a GPU keeps in its memory (torch tensors bound to ONNX Runtime by
    address; here on the CPU, the same code)."""
    model, tokenizer, _ = exported
    engine = engine_of(exported, decoder_kind=decoder_kind)
    prompts = [prompt_ids(tokenizer, t) for t in ("Return the", "raise ValueError", "café", "items in bucket 3",
                                                   "Return the number of items", "if it is")]
    results = staggered(engine, prompts, [CONTEXT - len(ids) for ids in prompts], 0.01)
    for ids, result in zip(prompts, results, strict=True):
        assert result.finish_reason in ("stop", "length")
        assert result.tokens == generate_greedy(model, ids, CONTEXT - len(ids), engine.eos_ids)
    assert engine.stats.steps < sum(len(r.tokens) for r in results)  # decode steps were shared
    assert engine.in_use == 0 and len(engine.free) == 4


@pytest.mark.parametrize("decoder_kind", DECODER_KINDS, ids=["host-cache", "bound-cache", "fixed-shape-step",
                                                         "fused-in-place", "fused-bound"])
def test_prompts_prefilled_in_chunks_get_the_reference_continuations(exported: tuple[GPT, Any, Path],
                                                                     decoder_kind: type[KVDecoder]) -> None:
    """A prefill budget of 5 tokens a step: prompts of 2 to ~20 tokens go into the cache in
    chunks (each continuing the slot's cache), some beside sequences already decoding, and each
    greedy continuation still equals PyTorch's."""
    model, tokenizer, _ = exported
    engine = engine_of(exported, decoder_kind=decoder_kind, prefill_tokens=5)
    prompts = [prompt_ids(tokenizer, t) for t in (f"{TEXTS[12]} {TEXTS[40]}", "café", TEXTS[3], "if it is",
                                                   f"{TEXTS[7]} items in bucket 3; raise ValueError")]
    assert max(len(ids) for ids in prompts) >= 15
    results = staggered(engine, prompts, [CONTEXT - len(ids) for ids in prompts], 0.01)
    for ids, result in zip(prompts, results, strict=True):
        assert result.tokens == generate_greedy(model, ids, CONTEXT - len(ids), engine.eos_ids)
    assert engine.in_use == 0 and len(engine.free) == 4


def test_a_chunk_continues_the_cache_as_one_whole_prefill_would(exported: tuple[GPT, Any, Path]) -> None:
    """The decoder's logits after a prompt prefilled in three chunks equal those of one prefill,
    and so does the cache they leave."""
    model, tokenizer, path = exported
    c = model.config
    ids = prompt_ids(tokenizer, f"{TEXTS[5]} {TEXTS[6]}")[:20]
    assert len(ids) == 20
    decoder = KVDecoder(str(path), CacheShape(c.n_layers, c.n_kv_heads, c.head_dim, c.seq_len), 2, threads=1)
    whole = decoder.prefill(0, ids)
    decoder.prefill(1, ids[:7])
    decoder.prefill(1, ids[7:8], 7)
    chunked = decoder.prefill(1, ids[8:], 8)
    np.testing.assert_allclose(chunked, whole, rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(decoder.keys[:, 1, :, :20], decoder.keys[:, 0, :, :20], rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(decoder.values[:, 1, :, :20], decoder.values[:, 0, :, :20], rtol=1e-4, atol=1e-5)
    assert decoder.lengths[0] == decoder.lengths[1] == 20


class LoggingDecoder(KVDecoder):
    """The host decoder, recording each run: ("prefill", tokens) or ("decode", rows)."""

    runs: list[tuple[str, int]]

    def prefill(self, slot: int, ids: list[int], start: int = 0) -> np.ndarray[Any, Any]:
        self.runs.append(("prefill", len(ids)))
        return super().prefill(slot, ids, start)

    def decode_kept(self, slots: list[int], tokens: list[int]) -> Any:
        self.runs.append(("decode", len(slots)))
        return super().decode_kept(slots, tokens)


def test_a_long_prompt_does_not_stall_the_running_streams(exported: tuple[GPT, Any, Path]) -> None:
    """A 40-token prompt arriving while a stream decodes, with 8 prompt tokens a step: no run
    prefills more than the budget, and the running stream gets a token between its chunks."""
    model, tokenizer, path = exported
    c = model.config
    decoder = LoggingDecoder(str(path), CacheShape(c.n_layers, c.n_kv_heads, c.head_dim, c.seq_len), 2, threads=1)
    decoder.runs = []
    engine = Engine(decoder, tokenizer, c.seq_len, EngineLimits(2, 4, 8, 30, prefill_tokens=8)).start()
    long = (prompt_ids(tokenizer, " ".join(TEXTS)) * 2)[:40]
    long_params = check_sampling(SamplingRequest(1), 8, len(long), CONTEXT)
    answered, arrived = threading.Event(), []
    submitted: list[Sequence] = []

    def on_token(sequence: Sequence, delta: str, reason: str | None) -> None:
        if not submitted:  # on the engine's thread, at the running stream's first token: no race with its end
            arrived.append(len(decoder.runs))
            submitted.append(engine.submit(long, long_params, lambda s, d, r: answered.set() if r else None))

    try:
        short = prompt_ids(tokenizer, "if it is")
        running = engine.submit(short, check_sampling(SamplingRequest(CONTEXT - len(short), ignore_eos=True), 8,
                                                      len(short), CONTEXT), on_token)
        assert answered.wait(30)
        assert submitted[0].finish_reason == "length" and running.finish_reason is None
    finally:
        engine.stop()
    after = decoder.runs[arrived[0]:]
    chunks = [i for i, (kind, _) in enumerate(after) if kind == "prefill"]
    assert [after[i][1] for i in chunks] == [8, 8, 8, 8, 8], after
    for one, two in itertools.pairwise(chunks):
        assert ("decode", 1) in after[one:two], after  # the running stream's token between chunks


def group_logging(kind: type[FusedKVDecoder]) -> type[FusedKVDecoder]:
    """``kind``, recording the rows of each run of whole prompts (their lengths) in ``groups``."""

    def prefill_rows(self: Any, first: int, prompts: list[list[int]]) -> np.ndarray[Any, Any]:
        self.groups = [*getattr(self, "groups", []), [len(p) for p in prompts]]
        return kind.prefill_rows(self, first, prompts)

    return type(f"GroupLogging{kind.__name__}", (kind,), {"prefill_rows": prefill_rows})


@pytest.mark.parametrize("decoder_kind", DECODER_KINDS[3:], ids=["fused-in-place", "fused-bound"])
def test_prompts_waiting_together_are_prefilled_in_one_run_within_the_budget(
        exported: tuple[GPT, Any, Path], decoder_kind: type[FusedKVDecoder]) -> None:
    """Five prompts queued before the engine starts, four slots, 24 prompt tokens a step: the
    first four take slots 0..3 and go in as few runs as the budget allows (each run's rows times
    its longest prompt within it), the fifth alone when a slot frees; every greedy continuation
    equals PyTorch's."""
    model, tokenizer, path = exported
    c = model.config
    decoder: Any = group_logging(decoder_kind)(str(path.with_name(FusedKVDecoder.FILE)),
                                               CacheShape(c.n_layers, c.n_kv_heads, c.head_dim, c.seq_len), 4,
                                               threads=1)
    engine = Engine(decoder, tokenizer, c.seq_len, EngineLimits(4, 8, 8, 30, prefill_tokens=24))
    decoder.groups = []  # the requests' prefills (not the engine's warm-up run at load)
    prompts = [prompt_ids(tokenizer, t) for t in ("Return the", "raise ValueError", "café", "items in bucket 3",
                                                   "if it is")]
    done = threading.Semaphore(0)
    sequences = [engine.submit(ids, check_sampling(SamplingRequest(CONTEXT - len(ids)), 8, len(ids), CONTEXT),
                               lambda s, d, r: done.release() if r else None) for ids in prompts]
    engine.start()
    try:
        for _ in prompts:
            assert done.acquire(timeout=60)
    finally:
        engine.stop()
    for ids, sequence in zip(prompts, sequences, strict=True):
        assert sequence.tokens == generate_greedy(model, ids, CONTEXT - len(ids), engine.eos_ids)
    assert all(len(rows) * max(rows) <= 24 for rows in decoder.groups), decoder.groups
    assert sorted(n for rows in decoder.groups for n in rows) == sorted(map(len, prompts)), decoder.groups
    assert max(map(len, decoder.groups)) > 1 and decoder.groups[-1] == [len(prompts[4])], decoder.groups


class RecordingDecoder:
    """What the engine asks a decoder that batches prefills, recorded: ("rows", first slot,
    prompt lengths) or ("chunk", slot, start, tokens); its logits pick token 5."""

    batches_prefills = True

    def __init__(self, vocab: int) -> None:
        self.vocab = vocab
        self.runs: list[tuple[Any, ...]] = []

    def warm(self, prefill_tokens: int) -> None:
        pass

    def logits(self, rows: int) -> np.ndarray[Any, Any]:
        found = np.zeros((rows, self.vocab), np.float32)
        found[:, 5] = 1.0
        return found

    def prefill(self, slot: int, ids: list[int], start: int = 0) -> np.ndarray[Any, Any]:
        self.runs.append(("chunk", slot, start, len(ids)))
        return self.logits(1)[0]

    def prefill_rows(self, first: int, prompts: list[list[int]]) -> np.ndarray[Any, Any]:
        self.runs.append(("rows", first, [len(p) for p in prompts]))
        return self.logits(len(prompts))


def prefills_of(exported: tuple[GPT, Any, Path], budget: int, lengths: list[int],
                slots_in_order: list[int], steps: int) -> list[list[tuple[Any, ...]]]:
    """The prefill runs of each of ``steps`` engine steps for prompts of ``lengths``, queued
    together and given slots in ``slots_in_order`` (the free list's order), oldest first."""
    _, tokenizer, _ = exported
    decoder = RecordingDecoder(tokenizer.get_vocab_size())
    engine = Engine(cast(KVDecoder, decoder), tokenizer, CONTEXT, EngineLimits(4, 8, 8, 30, prefill_tokens=budget))
    engine.free = list(reversed(slots_in_order))  # pop() takes the last
    params = check_sampling(SamplingRequest(4), 8, max(lengths), CONTEXT)
    for length in lengths:
        engine.admit(engine.submit([7] * length, params, lambda s, d, r: None))
    per_step = []
    for _ in range(steps):
        before = len(decoder.runs)
        engine.prefill_within_budget()
        per_step.append(decoder.runs[before:])
    return per_step


def test_the_prefill_budget_groups_neighbours_waits_for_room_and_starts_long_prompts_whole(
        exported: tuple[GPT, Any, Path]) -> None:
    """Whole prompts of neighbouring slots go in one run as far as the budget holds them padded
    to the longest (the oldest's neighbours below it too); a prompt the budget holds waits for a
    step with room rather than being cut; a prompt longer than the budget starts its chunks with
    a whole budget, so they are all of its size but the last."""
    assert prefills_of(exported, 24, [10, 10, 10], [0, 1, 2], 3) == [
        [("rows", 0, [10, 10])], [("rows", 2, [10])], []]
    # the oldest took slot 1, the younger slot 0: one run from slot 0
    assert prefills_of(exported, 24, [6, 9], [1, 0], 1) == [[("rows", 0, [9, 6])]]
    # slot 0's 5 tokens leave 3 of 8: the 20-token prompt starts at the next step, in chunks of 8
    assert prefills_of(exported, 8, [5, 20], [0, 1], 5) == [
        [("rows", 0, [5])], [("chunk", 1, 0, 8)], [("chunk", 1, 8, 8)], [("chunk", 1, 16, 4)], []]
    # a whole prompt behind a long one being chunked: never in its run, next in line
    assert prefills_of(exported, 8, [20, 3], [0, 1], 4) == [
        [("chunk", 0, 0, 8)], [("chunk", 0, 8, 8)], [("chunk", 0, 16, 4), ("rows", 1, [3])], []]


@pytest.mark.skipif(cuda_provider_present(), reason="on a GPU the fused decoder runs in float16")
@pytest.mark.parametrize("budget", [16, 24, 40, 64, 0])
def test_every_prefill_shape_the_engine_can_ask_for_is_warmed(exported: tuple[GPT, Any, Path], budget: int) -> None:
    """A GPU's decoder runs whole prompts in a few shapes, each run once at load (its first run
    costs 40-75 ms): whatever group of waiting prompts the engine forms within the step's budget
    (rows times the longest, each at most the context), every run it makes is one of them."""
    model, _, path = exported
    c = model.config
    slots = 8
    decoder = DeviceFusedKVDecoder(str(path.with_name(FusedKVDecoder.FILE)),
                                   CacheShape(c.n_layers, c.n_kv_heads, c.head_dim, c.seq_len), slots, threads=1)
    engine_budget = budget or c.seq_len * slots  # what Engine makes of 0
    warmed = set(decoder.warm_shapes(engine_budget))
    assert len(warmed) <= 16
    for rows in range(1, slots + 1):
        for longest in range(1, c.seq_len):
            if rows * longest <= engine_budget or rows == 1:
                # prompts all as long as the longest: the worst case (a narrower run of as many
                # rows is warmed where a wider one is)
                runs = decoder.shapes_of([longest] * rows)
                assert set(runs) <= warmed, (rows, longest, runs, sorted(warmed))


def test_an_exported_folder_gets_the_slots_its_budget_holds(exported: tuple[GPT, Any, Path], tmp_path: Path) -> None:
    """Engine.from_folder (what Triton's model.py calls): slots from kv_cache_bytes, at most
    max_slots; on a CPU the fused decoder where the export wrote one, else decoder.onnx."""
    import json
    import shutil

    from tasks.export import generation_shape

    model, tokenizer, path = exported
    shutil.copy(path, tmp_path / "decoder.onnx")
    tokenizer.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "generation.json").write_text(json.dumps(generation_shape(model, tokens.our_special_tokens(tokenizer))))
    slot = CacheShape(model.config.n_layers, model.config.n_kv_heads, model.config.head_dim, CONTEXT).slot_bytes
    engine = Engine.from_folder(str(tmp_path), EngineLimits(16, 4, 8, 30, kv_cache_bytes=5 * slot + slot // 2))
    assert engine.slots == 5 and engine.decoder.keys.shape[1] == 5 and len(engine.free) == 5
    assert type(engine.decoder) is KVDecoder
    shutil.copy(path.with_name(FusedKVDecoder.FILE), tmp_path / FusedKVDecoder.FILE)
    engine = Engine.from_folder(str(tmp_path), EngineLimits(3, 4, 8, 30, kv_cache_bytes=5 * slot))
    assert engine.slots == 3 and type(engine.decoder) is FusedKVDecoder


def test_the_outbox_sends_off_the_engines_thread_in_order_coalescing_what_queued_meanwhile(
        exported: tuple[GPT, Any, Path]) -> None:
    """Triton's model sends responses through an Outbox: its first send held until the engine has
    generated the whole answer, the rest goes out as one piece with the end (nothing lost or
    reordered: the text is the engine's, once); a sequence whose send fails reads as gone, and a
    failed end is not remembered."""
    _, tokenizer, _ = exported
    engine = engine_of(exported)
    outbox = Outbox()
    entered, release, ended = threading.Event(), threading.Event(), threading.Event()
    sent: list[tuple[str, str | None]] = []

    def send(sequence: Sequence, text: str, reason: str | None) -> None:
        if not sent:
            entered.set()
            assert release.wait(30)  # the engine runs on meanwhile
        sent.append((text, reason))
        if reason is not None:
            ended.set()

    ids = prompt_ids(tokenizer, "Return the")
    try:
        done = threading.Event()

        def emit(sequence: Sequence, delta: str, reason: str | None) -> None:
            outbox.put(sequence, delta, reason, send)
            if not entered.is_set():
                assert entered.wait(30)  # the first delta alone is being sent: the rest queues behind it
            if reason is not None:
                done.set()

        sequence = engine.submit(ids, check_sampling(SamplingRequest(20, ignore_eos=True), 8, len(ids), CONTEXT), emit)
        assert done.wait(30)  # the engine finished while the outbox's first send was held
        release.set()
        assert ended.wait(30)
    finally:
        engine.stop()
    assert len(sent) == 2 and sent[1][1] == "length", sent
    assert "".join(text for text, _ in sent) == tokenizer.decode(sequence.tokens)

    def failing(sequence: Sequence, text: str, reason: str | None) -> None:
        raise ConnectionError("the client is gone")

    gone = Sequence([1], check_sampling(SamplingRequest(2), 8, 1, CONTEXT), emit, lambda: False, 0.0,
                    Detokenizer(tokenizer, ()), np.random.default_rng(0))
    outbox.put(gone, "a", None, failing)
    deadline = time.monotonic() + 10
    while not outbox.gone(gone):
        assert time.monotonic() < deadline
        time.sleep(0.01)
    outbox.put(gone, "", "cancelled", failing)
    outbox.close()
    assert not outbox.gone(gone) and not outbox.thread.is_alive()


def test_limits_read_from_a_triton_configuration_old_or_new() -> None:
    """What Triton's model.py loads with and deploy counts: the configuration's string parameters;
    an older export's has no cache or prefill budget (0: none)."""
    from tasks.config import load
    from tasks.lib.triton import generate_model_config

    serve = load().serve
    new = EngineLimits.of_config(generate_model_config(serve.generate_model, serve))
    assert new == EngineLimits(serve.max_slots, serve.generate.max_queue, serve.generate.max_tokens,
                               serve.generate.request_timeout_s, int(serve.kv_cache_mb * 2**20),
                               serve.generate.prefill_tokens)
    old = {"parameters": {k: {"string_value": v} for k, v in
                          {"max_slots": "8", "max_queue": "64", "default_max_tokens": "24", "request_timeout_s": "60"}.items()}}
    assert EngineLimits.of_config(old) == EngineLimits(8, 64, 24, 60.0)


def test_the_kv_budget_sizes_the_slots() -> None:
    """As many whole-context caches as the budget holds, at most max_slots; none: refused, one line."""
    shape = CacheShape(layers=4, kv_heads=8, head_dim=64, context=256)  # cpu-small: 4 MiB a sequence
    assert shape.slot_bytes == 4 * 2**20
    assert EngineLimits(32, 8, 8, 60, kv_cache_bytes=64 * 2**20).slots_for(shape) == 16
    assert EngineLimits(8, 8, 8, 60, kv_cache_bytes=64 * 2**20).slots_for(shape) == 8
    assert EngineLimits(8, 8, 8, 60).slots_for(shape) == 8  # no budget: max_slots
    with pytest.raises(ValueError, match=r"^serve.kv_cache_mb 3: one sequence's cache takes 4.00 MiB for this model"):
        EngineLimits(8, 8, 8, 60, kv_cache_bytes=3 * 2**20).slots_for(shape)


def test_a_grouped_query_model_exports_and_serves_its_reference_continuations(
        exported: tuple[GPT, Any, Path], tmp_path: Path) -> None:
    """A checkpoint's architecture (one key/value head for four query heads, 16-channel heads,
    q/k/v biases, an untied head, llama3 rotary scaling) through the ONNX decoder export and the
    engine: a cache of the key/value heads only, and PyTorch's greedy continuations."""
    from tasks.export import export_decoder

    _, tokenizer, _ = exported
    torch.manual_seed(1)
    model = GPT(GPTConfig(vocab_size=tokenizer.get_vocab_size(), seq_len=CONTEXT, d_model=32, n_layers=2, n_heads=4,
                          n_kv_heads=1, head_size=16, qkv_bias=True, tie_embeddings=False,
                          rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                        "high_freq_factor": 4.0, "original_max_position_embeddings": 16})).eval()
    with torch.no_grad():
        for block in model.blocks:
            block.attn.qkv.bias.normal_(0.0, 0.5)
    export_decoder(model, tmp_path / "decoder.onnx", 18)
    engine = engine_of((model, tokenizer, tmp_path / "decoder.onnx"), slots=2)
    assert engine.decoder.shape == (2, 2, 1, CONTEXT, 16)  # (layers, slots, kv heads, context, head size)
    prompts = [prompt_ids(tokenizer, t) for t in ("Return the", "raise ValueError", "café")]
    results = staggered(engine, prompts, [CONTEXT - len(ids) for ids in prompts], 0.01)
    for ids, result in zip(prompts, results, strict=True):
        assert result.tokens == generate_greedy(model, ids, CONTEXT - len(ids), engine.eos_ids)


class GpuOnnxRuntime:
    """What onnxruntime-gpu says it has, whatever the machine (its TensorRT provider included)."""

    @staticmethod
    def get_available_providers() -> list[str]:
        return ["TensorrtExecutionProvider", "CUDAExecutionProvider", "CPUExecutionProvider"]


def test_providers_cuda_in_full_float32_and_tensorrt_only_where_asked_and_loadable(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """FP16 (TensorRT) and TF32 (CUDA's default) can change greedy text, which the canary compares with
    PyTorch's: CUDA runs in full float32, TensorRT only when serve.generate.tensorrt asks and
    its library loads (else ONNX Runtime would retry on CUDA without the options asked for)."""
    from tasks.serving.triton_models.llm_generate import engine

    shape = CacheShape(2, 4, 8, 48)
    cuda = ("CUDAExecutionProvider", {"use_tf32": "0"})
    assert KVDecoder.providers(GpuOnnxRuntime, shape, 4) == [cuda, "CPUExecutionProvider"]
    monkeypatch.setattr(engine, "tensorrt_runtime_present", lambda: False)
    assert KVDecoder.providers(GpuOnnxRuntime, shape, 4, tensorrt=True) == [cuda, "CPUExecutionProvider"]
    monkeypatch.setattr(engine, "tensorrt_runtime_present", lambda: True)
    tensorrt, *rest = KVDecoder.providers(GpuOnnxRuntime, shape, 4, tensorrt=True)
    assert tensorrt[0] == "TensorrtExecutionProvider" and rest == [cuda, "CPUExecutionProvider"]
    assert tensorrt[1]["trt_profile_max_shapes"].startswith("input_ids:4x48,past_keys:2x4x4x47x8")


@pytest.mark.skipif(tensorrt_runtime_present(), reason="TensorRT's library loads here")
def test_a_gpu_provider_that_fails_to_start_is_an_error_not_a_cpu_engine(exported: tuple[GPT, Any, Path],
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """ONNX Runtime logs a provider that fails to start (a missing CUDA library) and runs on the
    CPU: a GPU pod would then serve from its CPU without a word. The decoder refuses instead."""
    model, _, path = exported
    c = model.config
    # TensorRT without its libraries (here, and on the GPU machines these tests ran on)
    monkeypatch.setattr(KVDecoder, "providers", staticmethod(
        lambda ort, shape, slots, tensorrt=False: [("TensorrtExecutionProvider", {}), "CPUExecutionProvider"]))
    with pytest.raises(RuntimeError, match=r"runs it on \w+, not TensorrtExecutionProvider \(its log"):
        KVDecoder.open(str(path), CacheShape(c.n_layers, c.n_heads, c.head_dim, c.seq_len), 2)


@pytest.mark.skipif(not cuda_provider_present(), reason="no GPU or no onnxruntime-gpu: run on a GPU machine "
                                                         "(docs/testing.md)")
@pytest.mark.parametrize("cuda_graph", [False, True], ids=["launched", "cuda-graph"])
def test_on_a_gpu_the_engine_runs_on_cuda_with_the_cache_on_the_gpu_and_the_reference_continuations(
        tmp_path: Path, cuda_graph: bool) -> None:
    """What a GPU Triton pod runs: :meth:`KVDecoder.open` picks the CUDA provider (full float32:
    TF32 can change greedy text) and keeps the cache in the GPU's memory, its decode step
    replayed as a CUDA graph where asked. A model of 256 tokens' context, eight prompts on four
    slots joining a running batch: every greedy continuation of up to 128 tokens equals
    PyTorch's on the CPU, token for token."""
    import onnxruntime as ort

    from tasks.export import export_decoder

    tokenizer = tokens.train_tokenizer(TEXTS, 400)
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=tokenizer.get_vocab_size(), seq_len=256, d_model=256, n_layers=4,
                          n_heads=8)).eval()
    path = tmp_path / "decoder.onnx"
    export_decoder(model, path, 18)
    c = model.config
    decoder = KVDecoder.open(str(path), CacheShape(c.n_layers, c.n_heads, c.head_dim, c.seq_len), 4,
                             cuda_graph=cuda_graph)
    assert isinstance(decoder, DeviceKVDecoder) and decoder.device.type == "cuda", type(decoder)
    assert isinstance(decoder, GraphKVDecoder) == cuda_graph, type(decoder)
    if isinstance(decoder, GraphKVDecoder):
        step = decoder.step.get_provider_options()["CUDAExecutionProvider"]
        assert (step["enable_cuda_graph"], step["use_tf32"]) == ("1", "0"), step
    providers = decoder.session.get_providers()
    assert providers[0] == "CUDAExecutionProvider", (providers, ort.get_available_providers())
    assert decoder.session.get_provider_options()["CUDAExecutionProvider"]["use_tf32"] == "0"
    engine = Engine(decoder, tokenizer, c.seq_len, EngineLimits(4, 8, 8, 120)).start()
    prompts = [prompt_ids(tokenizer, t) for t in TEXTS[:8]]
    results = staggered(engine, prompts, [128] * len(prompts), 0.02, timeout_s=120)
    for ids, result in zip(prompts, results, strict=True):
        assert result.finish_reason in ("stop", "length"), result
        assert result.tokens == generate_greedy(model, ids, 128, engine.eos_ids)
    assert engine.in_use == 0 and engine.stats.failed == 0


def test_sampling_is_reproducible_by_seed_and_respects_stop_strings(exported: tuple[GPT, Any, Path]) -> None:
    _, tokenizer, _ = exported
    engine = engine_of(exported)
    ids = prompt_ids(tokenizer, "Return the")
    try:
        def text(**kwargs: Any) -> tuple[str, str | None]:
            pieces: list[str] = []
            done = threading.Event()

            def emit(sequence: Sequence, delta: str, reason: str | None) -> None:
                pieces.append(delta)
                if reason is not None:
                    done.set()

            sequence = engine.submit(ids, check_sampling(SamplingRequest(30, **kwargs), 8, len(ids), CONTEXT), emit)
            assert done.wait(30)
            return "".join(pieces), sequence.finish_reason

        sampled = {"temperature": 1.5, "top_p": 0.95, "top_k": 50}
        first, again, other = text(seed=7, **sampled), text(seed=7, **sampled), text(seed=8, **sampled)
        assert first == again and first != other
        whole, _ = text()
        stop = whole[5:8]
        cut, reason = text(stop=[stop])
        assert reason == "stop" and cut == whole[:whole.find(stop)]
    finally:
        engine.stop()


def test_ignore_eos_generates_exactly_max_tokens(exported: tuple[GPT, Any, Path]) -> None:
    """Benchmark clients (aiperf, vLLM's) ask for exactly ``max_tokens`` tokens: EOS does not end
    the sequence. The random model rarely says EOS, so the engine's EOS is taken to be the third
    token of its greedy continuation."""
    _, tokenizer, _ = exported
    engine = engine_of(exported)
    ids = prompt_ids(tokenizer, "Return the")
    room = CONTEXT - len(ids)
    try:
        free = generate(engine, ids, check_sampling(SamplingRequest(room), 8, len(ids), CONTEXT)).tokens
        engine.eos_ids = frozenset({free[2]})
        first_eos = free.index(free[2])
        stopped = generate(engine, ids, check_sampling(SamplingRequest(room), 8, len(ids), CONTEXT))
        forced = generate(engine, ids, check_sampling(SamplingRequest(room, ignore_eos=True), 8, len(ids), CONTEXT))
    finally:
        engine.stop()
    assert stopped.finish_reason == "stop" and stopped.tokens == free[:first_eos]
    assert forced.finish_reason == "length" and forced.tokens == free and len(free) == room


def test_a_full_queue_refuses_at_once_and_memory_stays_bounded(exported: tuple[GPT, Any, Path]) -> None:
    _, tokenizer, _ = exported
    engine = engine_of(exported, slots=1, queue=2)
    ids = prompt_ids(tokenizer, "Return the")
    params = check_sampling(SamplingRequest(CONTEXT - len(ids)), 8, len(ids), CONTEXT)
    ended = threading.Semaphore(0)
    try:
        accepted, refused = 0, 0
        for _ in range(12):
            try:
                engine.submit(ids, params, lambda s, d, r: r is not None and ended.release())  # type: ignore[func-returns-value]
                accepted += 1
            except Overloaded as exc:
                assert "overloaded" in str(exc)
                refused += 1
        assert accepted <= 3 and refused >= 9 and engine.stats.rejected == refused
        for _ in range(accepted):
            assert ended.acquire(timeout=30)
    finally:
        engine.stop()


def test_a_cancelled_request_frees_its_slot(exported: tuple[GPT, Any, Path]) -> None:
    _, tokenizer, _ = exported
    engine = engine_of(exported, slots=1)
    ids = prompt_ids(tokenizer, "Return the")
    gone = threading.Event()
    reasons: list[str | None] = []
    try:
        engine.submit(ids, check_sampling(SamplingRequest(CONTEXT - len(ids)), 8, len(ids), CONTEXT),
                      lambda s, d, r: reasons.append(r), cancelled=gone.is_set)
        gone.set()  # the client went away
        follower = generate(engine, ids, check_sampling(SamplingRequest(4), 8, len(ids), CONTEXT))
        assert follower.finish_reason == "length" and "cancelled" in reasons
        assert engine.stats.cancelled == 1 and engine.in_use == 0
    finally:
        engine.stop()


def test_the_engines_own_time_to_first_token_leaves_out_the_wait_for_a_slot(
        exported: tuple[GPT, Any, Path]) -> None:
    """What the shadow's judge compares (``timings_ms``): a request that waited for the only
    slot while another generated to the end of the context reports its own prefill, not the
    wait; the server's TTFT metric (a user's view) keeps the wait."""
    _, tokenizer, _ = exported
    engine = engine_of(exported, slots=1)
    ids = prompt_ids(tokenizer, "Return the")
    ahead_done = threading.Event()
    try:
        engine.submit(ids, check_sampling(SamplingRequest(CONTEXT - len(ids), ignore_eos=True), 8, len(ids), CONTEXT),
                      lambda s, d, r: r is not None and ahead_done.set())  # type: ignore[func-returns-value]
        waited = generate(engine, ids, check_sampling(SamplingRequest(4), 8, len(ids), CONTEXT))
        assert ahead_done.is_set(), "the second request did not wait for the slot"
    finally:
        engine.stop()
    ttft_ms, _ = waited.timings_ms()
    queued_ms = (waited.admitted_at - waited.submitted) * 1000
    assert queued_ms > 0 and ttft_ms == pytest.approx((waited.first_token_at - waited.admitted_at) * 1000)
    assert max(engine.stats.ttft_s) * 1000 >= queued_ms + ttft_ms * 0.999


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"max_tokens": 100}, "plus max_tokens 100 exceeds the model's context of 48"),
    ({"max_tokens": 0}, "max_tokens 0: expected at least 1"),
    ({"temperature": 3.0}, "temperature 3.0"),
    ({"top_p": 0.0}, "top_p 0.0"),
    ({"top_k": -1}, "top_k -1"),
    ({"stop": ["x" * 100]}, "stop"),
    ({"prompt_tokens": 0}, "prompt is empty"),
    ({"prompt_tokens": 48}, "leaves no room"),
])
def test_bad_settings_are_refused_with_one_line(kwargs: dict[str, Any], message: str) -> None:
    asked = SamplingRequest(**{k: v for k, v in kwargs.items() if k != "prompt_tokens"})
    with pytest.raises(RequestError, match=message.replace("(", r"\(")) as raised:
        check_sampling(asked, 8, kwargs.get("prompt_tokens", 5), CONTEXT)
    assert "\n" not in str(raised.value)
    assert check_sampling(SamplingRequest(), 64, 40, CONTEXT).max_tokens == 8  # an absent max_tokens fits the room left


def test_invalid_utf8_prompts_are_refused(exported: tuple[GPT, Any, Path]) -> None:
    engine = engine_of(exported)
    try:
        with pytest.raises(RequestError, match="not valid UTF-8"):
            engine.encode(b"caf\xc3")
        assert engine.encode("café".encode()) == prompt_ids(exported[1], "café")
    finally:
        engine.stop()


def test_a_prompt_too_long_for_the_context_is_refused_by_its_size_before_tokenizing(
        exported: tuple[GPT, Any, Path], monkeypatch: pytest.MonkeyPatch) -> None:
    """A prompt of more bytes than ``context`` tokens of the longest can hold cannot fit: refused
    by its length (a 16 MB prompt once held the model thread in the tokenizer for seconds); one
    that may fit is tokenized and judged by its token count."""
    engine = engine_of(exported)
    try:
        limit = engine.max_prompt_bytes
        assert limit >= engine.context * 4
        tokenized: list[str] = []
        encode = engine.tokenizer.encode
        monkeypatch.setattr(engine.tokenizer, "encode", lambda text, **kw: tokenized.append(text) or encode(text, **kw))
        for prompt in ("x" * (limit + 1), ("x" * (limit + 1)).encode(), "é" * (limit // 2 + 1), "x" * (16 << 20)):
            with pytest.raises(RequestError, match=rf"cannot fit the model's context of {engine.context} tokens"):
                engine.encode(prompt)
        assert tokenized == []
        assert len(engine.encode("x" * limit)) > 0 and len(tokenized) == 1
    finally:
        engine.stop()


class ByteTokenizer:
    """Token i is byte i: a character of several UTF-8 bytes spans several tokens."""

    def decode(self, ids: list[int]) -> str:
        return bytes(ids).decode("utf-8", errors="replace")


def test_text_deltas_never_split_a_character_or_show_a_stop_string() -> None:
    detok = Detokenizer(ByteTokenizer(), ())
    deltas = [detok.add(b)[0] for b in "é€a".encode()]
    assert deltas == ["", "é", "", "", "€", "a"]
    stops = Detokenizer(ByteTokenizer(), ("\nUser:",))
    shown: list[tuple[str, bool]] = []
    for byte in b"hi\nUser: more":
        shown.append(stops.add(byte))
        if shown[-1][1]:
            break
    assert "".join(d for d, _ in shown) == "hi" and len(shown) == len("hi\nUser:")


def test_incremental_deltas_add_up_to_the_whole_decode() -> None:
    """Decoding only the ids since the last whole character gives the text a decode of every id
    gives, for any bytes (valid text of 1-4 byte characters, invalid bytes, cut characters)."""
    rng = np.random.default_rng(0)
    pieces = ["a", " ", "é", "€", "😀", "\n"]
    for trial in range(200):
        data = b"".join(rng.choice(pieces).encode() if rng.random() < 0.8 else bytes([int(rng.integers(128, 256))])
                        for _ in range(int(rng.integers(1, 40))))
        detok = Detokenizer(ByteTokenizer(), ())
        shown = "".join(detok.add(byte)[0] for byte in data) + detok.flush()
        assert shown == data.decode("utf-8", errors="replace"), (trial, data)


@pytest.mark.parametrize("kind", ["wordpiece", "metaspace"])
def test_incremental_deltas_match_decoders_that_read_the_previous_piece(kind: str) -> None:
    """An operator may bring any tokenizer.json (the tokenizer_uri Param): decoders whose piece
    depends on the one before (WordPiece's ``##``, Metaspace's word-leading space) give the whole
    decode's text too."""
    from tokenizers import Tokenizer, decoders, models

    words = ["the", "##n", "hello", "##lo", "wor", "##ld", "é", "##s"]
    if kind == "wordpiece":
        tokenizer = Tokenizer(models.WordPiece({w: i for i, w in enumerate(["[UNK]", *words])}, unk_token="[UNK]"))
        tokenizer.decoder = decoders.WordPiece()
    else:
        pieces = ["▁the", "n", "▁hello", "lo", "▁wor", "ld", "▁é", "s"]
        tokenizer = Tokenizer(models.BPE({w: i for i, w in enumerate(["<unk>", *pieces])}, merges=[]))
        tokenizer.decoder = decoders.Metaspace()
    rng = np.random.default_rng(1)
    for _ in range(50):
        ids = [int(i) for i in rng.integers(1, len(words) + 1, size=int(rng.integers(1, 20)))]
        detok = Detokenizer(tokenizer, ())
        shown = "".join(detok.add(i)[0] for i in ids) + detok.flush()
        assert shown == tokenizer.decode(ids), ids


def test_greedy_sampling_is_argmax_and_top_k_one_is_greedy() -> None:
    from tasks.serving.triton_models.llm_generate.engine import SamplingParams, sample

    logits = np.asarray([0.1, 3.0, 2.9, -1.0], dtype=np.float32)
    rng = np.random.default_rng(0)
    assert sample(logits, SamplingParams(4), rng) == 1
    assert sample(logits, SamplingParams(4, temperature=1.0, top_k=1), rng) == 1
    picks = {sample(logits, SamplingParams(4, temperature=1.0, top_k=2), rng) for _ in range(200)}
    assert picks == {1, 2}
