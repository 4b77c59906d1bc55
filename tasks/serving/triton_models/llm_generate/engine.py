"""The generation engine: continuous batching over a KV-cache decoder run by ONNX Runtime.

Self-contained (numpy, onnxruntime, tokenizers; torch on GPUs): it ships in each exported
version's folder beside the Triton model that drives it (``model.py``), and the export step and
benchmarks import the same file, so what is parity-checked is what serves (the export checks the
host cache, on the CPU; the GPU's cache is the same arithmetic, tests/tasks/test_engine.py runs
both).

- :class:`KVDecoder`: ``decoder.onnx`` (the model's :meth:`GPT.forward_cached`) with a key/value
  cache preallocated for ``slots`` sequences of the full context (as many as ``serve.kv_cache_mb``
  holds, at most ``serve.max_slots``: :meth:`EngineLimits.slots_for`); a prefill writes a
  prompt's keys and values into its slot, a chunk at a time where it is long, a decode step runs
  every active sequence's last token at once (each sequence's past masked to its own length). On
  a GPU (:class:`DeviceKVDecoder`) the cache stays in the GPU's memory, bound to ONNX Runtime by
  address.
- :class:`Engine`: a scheduler thread. A request waits in a bounded admission queue (full: the
  submit fails at once with :class:`Overloaded`, memory never grows), takes a slot as soon as one
  is free, is prefilled within the step's budget of prompt tokens (``serve.generate.prefill_tokens``:
  a long prompt, or many arriving at once, is spread over steps, and the running sequences get a
  token between its chunks instead of waiting for every prompt; whole prompts of consecutive
  slots in one run where the decoder allows), then decodes one token per step
  with everyone else, and leaves when done, freeing its slot: continuous (in-flight) batching.
- Per-request sampling (:class:`SamplingParams`): greedy (temperature 0, deterministic and equal
  to the PyTorch reference), or temperature / top-k / top-p with a seeded generator (same seed,
  same text; one uniform number per token, drawn from the few tokens that can come out, found
  without sorting the vocabulary: :func:`nucleus`); stop strings; EOS. Text is detokenized
  incrementally: a delta never ends inside a UTF-8 character and never shows text that a stop
  string may still cut.
- The context is never slid: a prompt whose length plus ``max_tokens`` exceeds it is refused up
  front (:class:`RequestError`); an absent ``max_tokens`` takes the default within the room left.
"""

from __future__ import annotations

import bisect
import collections
import contextlib
import json
import math
import os
import tempfile
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np

try:  # in a Triton model repository: the export copies the serving contract beside this file
    from serving_contract import ENGINE_MAX_STOPS, MAX_STOP_CHARS, SAMPLING_LIMITS
except ImportError:  # imported from the repository (the export's parity check, tests, benchmarks)
    from tasks.serving.contract import ENGINE_MAX_STOPS, MAX_STOP_CHARS, SAMPLING_LIMITS

EOS = "<|endoftext|>"
REPLACEMENT = "\ufffd"  # what a partial UTF-8 sequence decodes to


class RequestError(ValueError):
    """A request the engine refuses (HTTP 400): the message is one line naming the input."""


class Overloaded(RuntimeError):
    """The admission queue is full (HTTP 429 / gRPC UNAVAILABLE): retry later."""


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int
    temperature: float = 0.0  # 0: greedy
    top_k: int = 0  # 0: the whole vocabulary
    top_p: float = 1.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False  # benchmarks: exactly max_tokens tokens (aiperf, vLLM's clients send it)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0 or self.top_k == 1


@dataclass(frozen=True)
class SamplingRequest:
    """A request's sampling settings as it sent them, unchecked (None: not sent):
    :func:`check_sampling` makes them :class:`SamplingParams`."""

    max_tokens: int | None = None
    temperature: float | None = None
    top_k: int | None = None
    top_p: float | None = None
    seed: int | None = None
    stop: list[str] | None = None
    ignore_eos: bool | None = None


def check_sampling(asked: SamplingRequest, default_max_tokens: int, prompt_tokens: int,
                   context: int) -> SamplingParams:
    """The request's sampling settings, or :class:`RequestError` naming the first bad one."""
    max_tokens, temperature, top_k, top_p = asked.max_tokens, asked.temperature, asked.top_k, asked.top_p
    for name, value in (("temperature", temperature), ("top_p", top_p), ("top_k", top_k), ("seed", asked.seed)):
        low, high = SAMPLING_LIMITS[name]
        if (value is not None and not (low <= value <= high)) or (name == "top_p" and value == 0.0):
            raise RequestError(f"{name} {value!r}: expected {'(0' if name == 'top_p' else f'[{low}'}, {high}]")
    if prompt_tokens == 0:
        raise RequestError("prompt is empty")
    room = context - prompt_tokens
    if room < 1:
        raise RequestError(f"prompt of {prompt_tokens} tokens leaves no room in the model's context of {context}")
    if max_tokens is None:
        max_tokens = min(default_max_tokens, room)
    elif max_tokens < 1:
        raise RequestError(f"max_tokens {max_tokens}: expected at least 1")
    elif max_tokens > room:
        raise RequestError(f"prompt of {prompt_tokens} tokens plus max_tokens {max_tokens} exceeds the model's "
                           f"context of {context} tokens")
    stops = tuple(asked.stop or ())
    if len(stops) > ENGINE_MAX_STOPS or any(not isinstance(s, str) or not s or len(s) > MAX_STOP_CHARS for s in stops):
        raise RequestError(f"stop {list(stops)!r}: expected at most {ENGINE_MAX_STOPS} non-empty strings of at most "
                           f"{MAX_STOP_CHARS} characters")
    return SamplingParams(int(max_tokens), float(temperature or 0.0), int(top_k or 0),
                          1.0 if top_p is None else float(top_p), asked.seed, stops, bool(asked.ignore_eos))


FLOAT32_MAX = float(np.finfo(np.float32).max)
TOP_K_SAMPLE = 2048  # logits read to guess the k-th highest: a strided sample's quantile
FIRST_BUDGET = 256  # the nucleus is first searched among at most 256 / (1 - top_p) tokens
BUDGET_GROWTH = 4


@dataclass(frozen=True, eq=False)
class Nucleus:
    """What a non-greedy draw picks from: token ids in the draw's order (None: the whole
    vocabulary, in id order) and their cumulative weights (float64, not normalized: the last is
    the nucleus' mass)."""

    ids: np.ndarray[Any, Any] | None
    cumulative: np.ndarray[Any, Any]

    @property
    def tokens(self) -> np.ndarray[Any, Any]:
        return np.arange(len(self.cumulative)) if self.ids is None else self.ids

    def draw(self, uniform: float) -> int:
        """The token at ``uniform`` (in [0, 1)) of the inverse CDF. A token of weight 0 is never
        drawn: the first cumulative weight strictly above the point."""
        at = int(np.searchsorted(self.cumulative, uniform * self.cumulative[-1], side="right"))
        if at == len(self.cumulative):  # the product rounded up to the mass: the last token that has weight
            at = int(np.searchsorted(self.cumulative, self.cumulative[-1]))
        return at if self.ids is None else int(self.ids[at])


def sample(logits: np.ndarray[Any, Any], params: SamplingParams, rng: np.random.Generator) -> int:
    """One token from next-token logits (vocab,): one uniform number of ``rng`` per token."""
    if params.greedy:
        return int(np.argmax(logits))
    return nucleus(logits, params).draw(rng.random())


def nucleus(logits: np.ndarray[Any, Any], params: SamplingParams) -> Nucleus:
    """The tokens a non-greedy draw picks from: the ``top_k`` highest logits (all when 0), then of
    those the fewest highest whose probability reaches ``top_p``. Ties go to the lower id: the
    order is logit descending, then id ascending; the draw follows it when ``top_p`` < 1, id
    order otherwise. The top-k is a partition of the few logits above a sampled guess, the
    nucleus a sort of the few above a cutoff whose mass reaches ``top_p``
    (:func:`heaviest_reaching`): the whole vocabulary is sorted only when most of it is the
    nucleus (a flat distribution). Weights are float32 (the highest is 1, so no temperature
    overflows them), their sums float64."""
    x = np.asarray(logits, dtype=np.float32).reshape(-1)
    top = float(x.max())  # NaN when any is
    if not np.isfinite(top):
        raise ValueError(f"the logits' maximum is {top}: expected a finite number")
    scale = min(1.0 / params.temperature, FLOAT32_MAX)  # a subnormal temperature: argmax and its ties
    ids = highest(x, params.top_k) if 0 < params.top_k < x.shape[0] else None  # None: all
    pool = x if ids is None else x[ids]
    with np.errstate(over="ignore"):  # a gap that overflows float32 at a tiny temperature: weight 0
        weights = pool - np.float32(top)  # one float32 array, scaled and exponentiated in place
        weights *= np.float32(scale)
        np.exp(weights, out=weights)
    if params.top_p >= 1.0:
        return Nucleus(ids, np.cumsum(weights, dtype=np.float64))
    total = float(weights.sum(dtype=np.float64))
    target = params.top_p * total
    chosen = heaviest_reaching(pool, weights, target, (1.0 - params.top_p) * total, top, scale)
    cumulative = np.cumsum(weights[chosen], dtype=np.float64)
    keep = min(int(np.searchsorted(cumulative, target)) + 1, len(chosen))  # the first to reach it
    return Nucleus(chosen[:keep] if ids is None else ids[chosen[:keep]], cumulative[:keep])


def highest(x: np.ndarray[Any, Any], k: int) -> np.ndarray[Any, Any]:
    """Ids, ascending, of the ``k`` (< len) highest logits; ties at the k-th value go to the lower
    ids. The k-th is found by a partition of the few logits at or above a guess (a strided
    sample's quantile: about 4k of them), not of the whole vocabulary."""
    stride = max(1, x.shape[0] // TOP_K_SAMPLE)
    sampled = x[::stride]
    rank = min(len(sampled), 4 * k // stride + 8)  # ~rank * stride logits reach the rank-th highest sampled
    candidates = np.flatnonzero(x >= np.partition(sampled, len(sampled) - rank)[len(sampled) - rank])
    if len(candidates) < k:  # a sample that over-represents the top: search them all
        candidates = np.arange(x.shape[0])
    values = x[candidates]
    kth = np.partition(values, len(values) - k)[len(values) - k]
    chosen = candidates[values >= kth]
    if len(chosen) > k:  # ties at the k-th value: keep the lower ids
        tied = np.flatnonzero(x[chosen] == kth)
        chosen = np.delete(chosen, tied[k - len(chosen):])
    return chosen


def heaviest_reaching(pool: np.ndarray[Any, Any], weights: np.ndarray[Any, Any], target: float, rest: float,
                      top: float, scale: float) -> np.ndarray[Any, Any]:
    """Positions in ``pool`` of all logits at or above a cutoff, whose weights reach ``target``,
    in the draw's order (logit descending, position ascending): the nucleus is their head. The
    cutoff's weight is ``rest`` (the mass outside the nucleus) / budget: at most budget / (1 -
    top_p) weights reach it, and when those fall short of ``target`` the budget grows."""
    budget = FIRST_BUDGET
    while budget < len(pool):
        if rest < budget:  # the cutoff's weight is below the highest's (1): some logits reach it
            chosen = np.flatnonzero(pool >= top + math.log(rest / budget) / scale)
            if weights[chosen].sum(dtype=np.float64) >= target:
                return chosen[np.argsort(-pool[chosen], kind="stable")]
        budget *= BUDGET_GROWTH
    return np.argsort(-pool, kind="stable")  # most of them: sort them all


def tensorrt_runtime_present() -> bool:
    """Whether TensorRT's own libraries load. onnxruntime-gpu lists its TensorRT provider whether or
    not they are installed, and on a failed start ONNX Runtime retries on CUDA without the
    provider options asked for (full float32 among them)."""
    import ctypes

    try:
        ctypes.CDLL("libnvinfer.so.10")  # the TensorRT major onnxruntime-gpu's provider links
    except OSError:
        return False
    return True


@dataclass(frozen=True)
class CacheShape:
    """What the key/value cache holds per sequence: ``layers`` of ``kv_heads`` heads (fewer than
    the attention heads under grouped-query attention) of ``head_dim``, for ``context`` positions."""

    layers: int
    kv_heads: int
    head_dim: int
    context: int

    @property
    def slot_bytes(self) -> int:
        """One sequence's keys and values over the whole context, in float32."""
        return 2 * self.layers * self.kv_heads * self.context * self.head_dim * 4

    @classmethod
    def of_generation(cls, generation: dict[str, Any]) -> CacheShape:
        """From an export's ``generation.json`` (exports before grouped-query attention: n_heads)."""
        return cls(int(generation["n_layers"]), int(generation.get("n_kv_heads", generation["n_heads"])),
                   int(generation["head_dim"]), int(generation["seq_len"]))


def bind_tensor(bind: Any, name: str, tensor: Any) -> None:
    """A torch tensor or numpy array bound by address (``bind``: an IO binding's bind_input or
    bind_output)."""
    if isinstance(tensor, np.ndarray):
        bind(name, "cpu", 0, tensor.dtype, tensor.shape, tensor.ctypes.data)
        return
    dtype = {"torch.int64": np.int64, "torch.int32": np.int32, "torch.float32": np.float32,
             "torch.float16": np.float16}[str(tensor.dtype)]
    bind(name, tensor.device.type, tensor.device.index or 0, dtype, tuple(tensor.shape), tensor.data_ptr())


def settle(torch: Any, device: Any) -> None:
    """torch's writes to bound buffers done before ONNX Runtime's CUDA stream reads them."""
    if device.type == "cuda":
        torch.cuda.current_stream(device).synchronize()


def host_rows(logits: Any, rows: np.ndarray[Any, Any]) -> np.ndarray[Any, Any]:
    """``rows`` of torch logits, copied to the host."""
    import torch

    return logits.index_select(0, torch.as_tensor(rows, device=logits.device)).cpu().numpy()  # type: ignore[no-any-return]


def argmax_to_host(logits: Any) -> np.ndarray[Any, Any]:
    """Each row's argmax of torch logits (ties: the lowest id, as numpy's), its ids alone copied."""
    return logits.argmax(-1).cpu().numpy()  # type: ignore[no-any-return]


def total_length(ids: np.ndarray[Any, Any], last: np.ndarray[Any, Any]) -> np.ndarray[Any, Any]:
    """GroupQueryAttention's ``total_sequence_length`` of a run of new tokens ``ids`` whose last
    land at ``last``: the longest row's length after them, or the padded width of first prompts
    (equal to the new tokens' count: how the operator tells first prompts)."""
    return np.asarray(max(int(last.max()) + 1, ids.shape[1]), np.int32)


def fixed_step_session(onnx_path: str, slots: int, context: int, threads: int, cuda: bool) -> Any:
    """A session of a decoder whose decode step has one shape (ONNX Runtime's free dimension
    overrides of the exports' axis names: every slot, one new token, the whole context as the
    past): its shapes fold to constants, so on CUDA every node runs there and the provider
    captures the step as a CUDA graph on its first runs and replays it with one launch."""
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.intra_op_num_threads = threads
    options.add_session_config_entry("session.intra_op.allow_spinning", "0")
    for axis, size in (("batch", slots), ("new", 1), ("past", context)):
        options.add_free_dimension_override_by_name(axis, size)
    providers: list[Any] = [("CUDAExecutionProvider", {"use_tf32": "0", "enable_cuda_graph": "1"})] if cuda else []
    return ort.InferenceSession(onnx_path, options, providers=[*providers, "CPUExecutionProvider"])


class KVDecoder:
    """``decoder.onnx`` and the key/value cache of ``slots`` sequences."""

    INPUTS = ("input_ids", "past_keys", "past_values", "past_lengths")
    OUTPUTS = ("logits", "present_keys", "present_values")  # (batch, vocab), the new positions' keys, values
    keys: Any  # (layers, slots, heads, context, head_dim): numpy here, torch in DeviceKVDecoder
    values: Any
    placeholder: Any  # the masked one-position past of a prefill
    # the metadata key of a decoder whose logits are each row's last real position
    # (decoder_graph.build), so that first prompts of several slots prefill in one run; a fused
    # decoder exported before it reads the batch's last position: one prompt a run
    BATCHED_PREFILL = "batched_prefill"

    def __init__(self, onnx_path: str, shape: CacheShape, slots: int, threads: int = 0, session: Any = None) -> None:
        self.onnx_path = onnx_path
        self.session = session or self.open_session(onnx_path, shape, slots, threads)[0]
        self.vocab = int(next(o.shape[-1] for o in self.session.get_outputs() if o.name == "logits"))
        self.shape = (shape.layers, slots, shape.kv_heads, shape.context, shape.head_dim)
        self.lengths = np.zeros(slots, np.int64)
        self.batches_prefills = self.session.get_modelmeta().custom_metadata_map.get(self.BATCHED_PREFILL) == "1"
        self.allocate()

    @classmethod
    def open(cls, onnx_path: str, shape: CacheShape, slots: int, threads: int = 0,
             tensorrt: bool = False, cuda_graph: bool = False) -> KVDecoder:
        """The decoder for wherever ONNX Runtime runs it: on a GPU (CUDA or TensorRT provider) the
        cache lives in the GPU's memory (:class:`DeviceKVDecoder`), its decode step a CUDA graph
        on the CUDA provider where asked (:class:`GraphKVDecoder`), else in the host's, updated in
        place by the fused decoder where the export wrote one beside ``onnx_path``
        (:class:`FusedKVDecoder`)."""
        import onnxruntime as ort

        fused = os.path.join(os.path.dirname(onnx_path), FusedKVDecoder.FILE)
        if cls.providers(ort, shape, slots, tensorrt)[0] == "CPUExecutionProvider" and os.path.exists(fused):
            return FusedKVDecoder(fused, shape, slots, threads)
        session, asked = cls.open_session(onnx_path, shape, slots, threads, tensorrt)
        if session.get_providers()[0] != asked[0]:  # ONNX Runtime logs a provider that failed to start, then goes on
            raise RuntimeError(f"{onnx_path}: ONNX Runtime runs it on {session.get_providers()[0]}, not {asked[0]} "
                               "(its log above says why: a missing CUDA, cuDNN or TensorRT library)")
        kind = (KVDecoder if asked[0] == "CPUExecutionProvider"
                else GraphKVDecoder if cuda_graph and asked[0] == "CUDAExecutionProvider" else DeviceKVDecoder)
        return kind(onnx_path, shape, slots, threads, session)

    @classmethod
    def open_session(cls, onnx_path: str, shape: CacheShape, slots: int, threads: int,
                     tensorrt: bool = False) -> tuple[Any, list[str]]:
        """The session, and the providers it was asked for, best first."""
        import onnxruntime as ort

        options = ort.SessionOptions()
        options.intra_op_num_threads = threads
        # no spin-waiting between ops: a Triton serving a stable and a canary runs four ONNX
        # Runtime sessions (two engines, two logits models) on the same cores, and threads spinning
        # for work took the CPU from the busy ones (a good canary's inter-token latency read 5x
        # stable's at 50% in a test)
        options.add_session_config_entry("session.intra_op.allow_spinning", "0")
        providers = cls.providers(ort, shape, slots, tensorrt)
        session = ort.InferenceSession(onnx_path, options, providers=providers)
        return session, [p if isinstance(p, str) else p[0] for p in providers]

    def allocate(self) -> None:
        # written once here, so the memory is taken at load (what deploy counted), not page by
        # page as slots fill under load (np.zeros' pages are mapped on first write)
        self.keys, self.values = np.empty(self.shape, np.float32), np.empty(self.shape, np.float32)
        self.keys.fill(0.0)
        self.values.fill(0.0)
        layers, _, heads, _, head_dim = self.shape
        self.placeholder = np.zeros((layers, 1, heads, 1, head_dim), np.float32)

    @staticmethod
    def providers(ort: Any, shape: CacheShape, slots: int, tensorrt: bool = False) -> list[Any]:
        """TensorRT (where asked: ``serve.generate.tensorrt``), then CUDA where this onnxruntime has
        them (the GPU serving image), else the CPU. TensorRT builds its engine from the same
        decoder.onnx, FP16, with one optimization profile over the batch (1 prefill .. ``slots``
        decoding) and the past length (1 .. context - 1), cached in the scratch folder (the
        model's is read-only in a pod), so a restarted container does not build it again."""
        available = ort.get_available_providers()
        chosen: list[Any] = []
        if tensorrt and "TensorrtExecutionProvider" in available and tensorrt_runtime_present():
            layers, heads, head_dim, context = shape.layers, shape.kv_heads, shape.head_dim, shape.context

            def shapes(batch: int, tokens: int, past: int) -> str:
                kv = f"{layers}x{batch}x{heads}x{past}x{head_dim}"
                return (f"input_ids:{batch}x{tokens},past_keys:{kv},past_values:{kv},"
                        f"past_lengths:{batch}")

            chosen.append(("TensorrtExecutionProvider", {
                "trt_fp16_enable": True, "trt_engine_cache_enable": True,
                "trt_engine_cache_path": os.path.join(tempfile.gettempdir(), "ort-trt-cache"),
                "trt_profile_min_shapes": shapes(1, 1, 1),
                "trt_profile_opt_shapes": shapes(slots, 1, context // 2),
                "trt_profile_max_shapes": shapes(slots, context, context - 1)}))
        if "CUDAExecutionProvider" in available:
            # full float32 matrix products: TF32 (the CUDA provider's default on Ampere and later)
            # can change greedy continuations, which must equal the PyTorch reference's (the canary)
            chosen.append(("CUDAExecutionProvider", {"use_tf32": "0"}))
        return [*chosen, "CPUExecutionProvider"]

    def prefill(self, slot: int, ids: list[int], start: int = 0) -> np.ndarray[Any, Any]:
        """The keys and values of prompt tokens ``ids`` into ``slot`` from position ``start`` (a
        later chunk of a long prompt continues the slot's cache); returns the next-token logits
        after them (vocab,)."""
        past_keys = self.keys[:, slot:slot + 1, :, :start] if start else self.placeholder
        past_values = self.values[:, slot:slot + 1, :, :start] if start else self.placeholder
        logits, keys, values = self.session.run(None, {
            "input_ids": np.asarray([ids], np.int64), "past_keys": past_keys,
            "past_values": past_values, "past_lengths": np.asarray([start], np.int64)})
        end = start + len(ids)
        self.keys[:, slot, :, start:end], self.values[:, slot, :, start:end] = keys[:, 0], values[:, 0]
        self.lengths[slot] = end
        return logits[0]  # type: ignore[no-any-return]

    def prefill_rows(self, first: int, prompts: list[list[int]]) -> np.ndarray[Any, Any]:
        """The whole ``prompts`` of slots ``first``, ``first`` + 1, ... (each slot's first
        tokens); returns the next-token logits after each (rows, vocab). One run where the
        decoder :attr:`batches_prefills` (a GPU step is launch-bound: four prompts cost what one
        does), else one a prompt."""
        return np.stack([self.prefill(first + row, prompt) for row, prompt in enumerate(prompts)])

    def warm(self, prefill_tokens: int) -> None:
        """The engine's large runs, once, before any sequence takes a slot: a prefill of a step's
        whole token budget, then a decode step of every slot at the whole context, so that ONNX
        Runtime's arena and the host's buffers take their working size at load (as TGI's warmup
        and vLLM's profile run do), not under a first burst (docs/benchmarks.md). Left out: a
        later chunk of a prompt longer than the budget, over a long past, which may still grow
        the arena once. What the runs leave in the cache lies past every row's length, which
        goes back to 0: a row's next tokens overwrite it before anything reads it."""
        slots, context = self.shape[1], self.shape[3]
        self.prefill_rows(0, [[0] * max(1, min(prefill_tokens, context - 1))])
        self.lengths[:] = context - 1
        self.decode(list(range(slots)), [0] * slots)
        self.lengths[:] = 0

    def decode(self, slots: list[int], tokens: list[int]) -> np.ndarray[Any, Any]:
        """One token for each of ``slots`` at once; returns their next-token logits (batch, vocab)."""
        return self.host(self.decode_kept(slots, tokens), np.arange(len(slots)))

    def host(self, logits: Any, rows: np.ndarray[Any, Any]) -> np.ndarray[Any, Any]:
        """``rows`` of a step's logits (:meth:`decode_kept`) in the host's memory."""
        return logits[rows]  # type: ignore[no-any-return]

    def argmax(self, logits: Any) -> np.ndarray[Any, Any]:
        """Each row's highest logit's id (ties: the lowest id), computed where the logits lie."""
        return np.argmax(logits, axis=-1)

    def decode_kept(self, slots: list[int], tokens: list[int]) -> Any:
        """:meth:`decode`, its logits left where the decoder wrote them (on a GPU: only greedy
        picks and the rows that draw cross to the host, not 32 rows of a 50k vocabulary)."""
        index = np.asarray(slots)
        lengths = self.lengths[index]
        past = int(lengths.max())
        logits, keys, values = self.session.run(None, {
            "input_ids": np.asarray(tokens, np.int64)[:, None], "past_keys": self.keys[:, index, :, :past],
            "past_values": self.values[:, index, :, :past], "past_lengths": lengths})
        self.keys[:, index, :, lengths] = keys[:, :, :, 0].transpose(1, 0, 2, 3)
        self.values[:, index, :, lengths] = values[:, :, :, 0].transpose(1, 0, 2, 3)
        self.lengths[index] += 1
        return logits  # type: ignore[no-any-return]


class FusedKVDecoder(KVDecoder):
    """``decoder_fused.onnx`` (built by the export, ``tasks/lib/decoder_graph.py``): ONNX
    Runtime's GroupQueryAttention writes each new key and value into the cache where it lies
    (past and present bound to the same buffer) and attends over each row's own length, so a step
    copies no past. A prefill runs on its slot's row of the cache (the first prompts of
    consecutive slots on their rows at once: :meth:`prefill_rows`); a decode step on the rows up to
    the highest running slot (contiguous in memory; free slots are taken lowest first), where a
    row that is not decoding computes a dummy token at its own length and writes it where its
    next token will overwrite it. The CPU's decoder where the export built one."""

    FILE = "decoder_fused.onnx"
    step_ids: Any  # a decode step's buffers: numpy here, torch in DeviceFusedKVDecoder
    step_last: Any
    step_logits: Any

    @staticmethod
    def providers(ort: Any, shape: CacheShape, slots: int, tensorrt: bool = False) -> list[Any]:
        return ["CPUExecutionProvider"]  # its cache is the host's (the GPU's: DeviceFusedKVDecoder)

    def prefill(self, slot: int, ids: list[int], start: int = 0) -> np.ndarray[Any, Any]:
        end = start + len(ids)
        logits = self.run(slot, slot + 1, np.asarray([ids], np.int64), np.asarray([end - 1], np.int32))
        self.lengths[slot] = end
        return logits[0]  # type: ignore[no-any-return]

    def prefill_rows(self, first: int, prompts: list[list[int]]) -> np.ndarray[Any, Any]:
        if not self.batches_prefills:
            return super().prefill_rows(first, prompts)
        return self.first_prompts(first, prompts, max(map(len, prompts)))

    def first_prompts(self, first: int, prompts: list[list[int]], width: int) -> np.ndarray[Any, Any]:
        """One run of ``prompts`` into slots ``first``.. (:meth:`prefill_rows`), right-padded to
        ``width`` (at least the longest; the padding's keys land past each row's length, where
        its next tokens overwrite them)."""
        lengths = np.fromiter(map(len, prompts), np.int64, len(prompts))
        ids = np.zeros((len(prompts), width), np.int64)
        for row, prompt in enumerate(prompts):
            ids[row, :len(prompt)] = prompt
        logits = self.run(first, first + len(prompts), ids, (lengths - 1).astype(np.int32))
        self.lengths[first:first + len(prompts)] = lengths
        return logits

    def allocate(self) -> None:
        super().allocate()
        slots = self.shape[1]
        # a decode step's inputs and logits, rows 0..span - 1 of them bound for a step over that span
        self.step_ids, self.step_last = np.zeros((slots, 1), np.int64), np.zeros(slots, np.int32)
        self.step_logits = np.empty((slots, self.vocab), np.float32)
        self.step_bindings: dict[int, Any] = {}

    def decode_kept(self, slots: list[int], tokens: list[int]) -> Any:
        rows = np.asarray(slots)
        span = int(rows.max()) + 1
        ids, last = self.step_inputs(rows, tokens, span)
        self.step_ids[:span], self.step_last[:span] = ids, last
        total = np.asarray(int(last.max()) + 1, np.int32)  # named: it must outlive the run
        self.session.run_with_iobinding(self.step_binding(span, total))
        self.lengths[rows] += 1
        return self.step_logits[rows]

    def step_binding(self, span: int, total: np.ndarray[Any, Any]) -> Any:
        """The binding of a decode step over cache rows 0..``span`` - 1, made once per span: the
        cache's rows (two buffers a layer) and the step's buffers stay bound by address, and a
        step rebinds only its total length, where it bound every tensor anew."""
        binding = self.step_bindings.get(span)
        if binding is None:
            binding = self.step_bindings[span] = self.bind(
                self.session, (self.step_ids[:span], self.step_last[:span], total), slice(0, span),
                self.step_logits[:span])
        else:
            binding.bind_cpu_input("total_sequence_length", total)
        return binding

    def step_inputs(self, rows: np.ndarray[Any, Any], tokens: list[int],
                    span: int) -> tuple[np.ndarray[Any, Any], np.ndarray[Any, Any]]:
        """A decode step's token ids and new positions for cache rows 0..``span`` - 1: ``tokens``
        at ``rows``; a dummy token at each other row's own length (where its next one lands)."""
        ids = np.zeros((span, 1), np.int64)
        ids[rows, 0] = tokens
        last = np.minimum(self.lengths[:span], self.shape[3] - 1).astype(np.int32)
        last[rows] = self.lengths[rows]
        return ids, last

    def run(self, first: int, end: int, ids: np.ndarray[Any, Any], last: np.ndarray[Any, Any]) -> np.ndarray[Any, Any]:
        """The decoder over cache rows ``first``..``end`` - 1, each with new tokens ``ids`` of which
        the last lands at position ``last``; returns the logits after each row's last token."""
        logits = np.empty((end - first, self.vocab), np.float32)
        total = total_length(ids, last)
        self.session.run_with_iobinding(self.bind(self.session, (ids, last, total), slice(first, end), logits))
        return logits

    def bind(self, session: Any, step: tuple[Any, Any, np.ndarray[Any, Any]], rows: slice, logits: Any) -> Any:
        """``session`` bound to a step's token ids, last positions and total length (``step``),
        the cache's ``rows`` (read and written in place) and ``logits``."""
        ids, last, total = step
        binding = session.io_binding()
        bind_tensor(binding.bind_input, "input_ids", ids)
        bind_tensor(binding.bind_input, "seqlens_k", last)
        binding.bind_cpu_input("total_sequence_length", total)
        for layer in range(self.shape[0]):
            for kind, cache in (("key", self.keys), ("value", self.values)):
                held = cache[layer, rows]  # contiguous
                bind_tensor(binding.bind_input, f"past_{kind}_{layer}", held)
                bind_tensor(binding.bind_output, f"present_{kind}_{layer}", held)
        bind_tensor(binding.bind_output, "logits", logits)
        return binding


class DeviceKVDecoder(KVDecoder):
    """The cache in the accelerator's memory (torch tensors) and bound to the session by address
    (ONNX Runtime's IO binding): a step moves only token ids and lengths in and the batch's logits
    out, where the host cache would copy every active sequence's past keys and values to the GPU
    and the new ones back per token. torch does the cache's gather and scatter (the GPU serving
    image has it)."""

    def warm(self, prefill_tokens: int) -> None:
        """Not run: a cache in the device's memory (the fused decoder warms its GPU shapes:
        :meth:`DeviceFusedKVDecoder.warm`)."""

    def allocate(self) -> None:
        import torch

        self.torch = torch
        provider = self.session.get_providers()[0]
        self.device = torch.device("cpu" if provider == "CPUExecutionProvider" else "cuda", 0)
        self.keys = torch.zeros(self.shape, dtype=torch.float32, device=self.device)
        self.values = torch.zeros_like(self.keys)
        layers, _, heads, _, head_dim = self.shape
        self.placeholder = torch.zeros((layers, 1, heads, 1, head_dim), dtype=torch.float32, device=self.device)

    def run(self, ids: Any, past_keys: Any, past_values: Any, past_lengths: Any) -> tuple[Any, Any, Any]:
        """One run of the decoder on tensors already on the device; returns its outputs there."""
        torch = self.torch
        batch, new = ids.shape
        layers, _, heads, _, head_dim = self.shape
        logits = torch.empty((batch, self.vocab), dtype=torch.float32, device=self.device)
        present_keys = torch.empty((layers, batch, heads, new, head_dim), dtype=torch.float32, device=self.device)
        present_values = torch.empty_like(present_keys)
        binding = self.bind(self.session, (ids, past_keys, past_values, past_lengths),
                            (logits, present_keys, present_values))
        settle(torch, self.device)
        self.session.run_with_iobinding(binding)  # returns once the outputs are written
        return logits, present_keys, present_values

    def bind(self, session: Any, inputs: tuple[Any, ...], outputs: tuple[Any, ...]) -> Any:
        """``session``'s inputs and outputs bound to these tensors by address."""
        binding = session.io_binding()
        for name, tensor in zip(self.INPUTS, inputs, strict=True):
            bind_tensor(binding.bind_input, name, tensor)
        for name, tensor in zip(self.OUTPUTS, outputs, strict=True):
            bind_tensor(binding.bind_output, name, tensor)
        return binding

    def prefill(self, slot: int, ids: list[int], start: int = 0) -> np.ndarray[Any, Any]:
        torch, end = self.torch, start + len(ids)
        tokens = torch.tensor([ids], dtype=torch.int64, device=self.device)
        past_keys = self.keys[:, slot:slot + 1, :, :start].contiguous() if start else self.placeholder
        past_values = self.values[:, slot:slot + 1, :, :start].contiguous() if start else self.placeholder
        at = torch.tensor([start], dtype=torch.int64, device=self.device)
        logits, keys, values = self.run(tokens, past_keys, past_values, at)
        self.keys[:, slot, :, start:end], self.values[:, slot, :, start:end] = keys[:, 0], values[:, 0]
        self.lengths[slot] = end
        return logits[0].cpu().numpy()  # type: ignore[no-any-return]

    def decode_kept(self, slots: list[int], tokens: list[int]) -> Any:
        torch = self.torch
        rows = np.asarray(slots)
        lengths = self.lengths[rows]
        past = int(lengths.max())
        index = torch.tensor(slots, device=self.device)
        at = torch.from_numpy(lengths).to(self.device)  # each row's past length: masked, then written at
        logits, keys, values = self.run(
            torch.tensor(tokens, dtype=torch.int64, device=self.device)[:, None],
            self.keys[:, :, :, :past].index_select(1, index), self.values[:, :, :, :past].index_select(1, index), at)
        self.keys[:, index, :, at] = keys[:, :, :, 0].permute(1, 0, 2, 3)
        self.values[:, index, :, at] = values[:, :, :, 0].permute(1, 0, 2, 3)
        self.lengths[rows] += 1
        return logits

    host = staticmethod(host_rows)
    argmax = staticmethod(argmax_to_host)


class GraphKVDecoder(DeviceKVDecoder):
    """:class:`DeviceKVDecoder` whose decode step is one CUDA graph: ONNX Runtime captures the
    step's hundreds of kernels once and replays them with one launch (a 91M model's step was
    launch-bound: 4.1 ms on an H100 for ~0.3 ms of memory traffic). A graph needs the same shapes
    and addresses at every replay, so the step runs on a second session of the same
    ``decoder.onnx`` with its axes fixed (ONNX Runtime's free dimension overrides: every row of
    the cache, the whole context as the past, one new token; shapes fold to constants, so every
    node runs on the GPU) and bound once to buffers that each step refills in place: idle rows
    decode a dummy token at length 0 and their outputs are dropped. The past is read where it
    lies, never gathered. Prefills (their lengths vary) stay on the first session. On the CPU (the
    tests) the same fixed-shape session runs without a graph."""

    def __init__(self, onnx_path: str, shape: CacheShape, slots: int, threads: int = 0, session: Any = None) -> None:
        super().__init__(onnx_path, shape, slots, threads, session)
        self.step = fixed_step_session(onnx_path, slots, shape.context, threads, self.device.type == "cuda")
        torch, (layers, _, heads, _, head_dim) = self.torch, self.shape
        self.step_ids = torch.zeros((slots, 1), dtype=torch.int64, device=self.device)
        self.step_lengths = torch.zeros(slots, dtype=torch.int64, device=self.device)
        self.step_logits = torch.empty((slots, self.vocab), dtype=torch.float32, device=self.device)
        self.step_keys = torch.empty((layers, slots, heads, 1, head_dim), dtype=torch.float32, device=self.device)
        self.step_values = torch.empty_like(self.step_keys)
        self.binding = self.bind(self.step, (self.step_ids, self.keys, self.values, self.step_lengths),
                                 (self.step_logits, self.step_keys, self.step_values))

    def decode_kept(self, slots: list[int], tokens: list[int]) -> Any:
        torch = self.torch
        rows = np.asarray(slots)
        ids, lengths = np.zeros((len(self.lengths), 1), np.int64), np.zeros(len(self.lengths), np.int64)
        ids[rows, 0], lengths[rows] = tokens, self.lengths[rows]
        self.step_ids.copy_(torch.from_numpy(ids))
        self.step_lengths.copy_(torch.from_numpy(lengths))
        settle(torch, self.device)
        self.step.run_with_iobinding(self.binding)  # the first runs capture the graph, later ones replay it
        index = torch.from_numpy(rows).to(self.device)
        at = self.step_lengths.index_select(0, index)
        self.keys[:, index, :, at] = self.step_keys[:, index, :, 0].permute(1, 0, 2, 3)
        self.values[:, index, :, at] = self.step_values[:, index, :, 0].permute(1, 0, 2, 3)
        self.lengths[rows] += 1
        return self.step_logits.index_select(0, index)


class DeviceFusedKVDecoder(FusedKVDecoder):
    """The fused decoder with its cache in the accelerator's memory (torch tensors, in the
    decoder's precision: ONNX Runtime's GroupQueryAttention runs on CUDA in float16 or bfloat16
    only, so a GPU runs the half-precision build, ``decoder_graph.build(half=True)``), its decode
    step one CUDA graph over every slot (:func:`fixed_step_session`; the total length fixed at the
    context, each row's own length read from ``seqlens_k``), prefills on the first session. On
    the CPU (the tests) the same code without a graph."""

    providers = staticmethod(KVDecoder.providers)
    NARROWEST = 16  # the narrowest width a whole prompt is padded to

    def allocate(self) -> None:
        import torch

        self.torch = torch
        cuda = self.session.get_providers()[0] != "CPUExecutionProvider"
        self.device = torch.device("cuda", 0) if cuda else torch.device("cpu")
        half = next(i.type for i in self.session.get_inputs() if i.name == "past_key_0") == "tensor(float16)"
        self.keys = torch.zeros(self.shape, dtype=torch.float16 if half else torch.float32, device=self.device)
        self.values = torch.zeros_like(self.keys)
        _, slots, _, context, _ = self.shape
        self.step = fixed_step_session(self.onnx_path, slots, context, 0, cuda)
        self.step_ids = torch.zeros((slots, 1), dtype=torch.int64, device=self.device)
        self.step_last = torch.zeros(slots, dtype=torch.int32, device=self.device)
        self.step_logits = torch.empty((slots, self.vocab), dtype=torch.float32, device=self.device)
        self.step_total = np.asarray(context, np.int32)  # a host input of the operator: one value for the graph
        self.binding = self.bind(self.step, (self.step_ids, self.step_last, self.step_total), slice(0, slots),
                                 self.step_logits)

    def prefill(self, slot: int, ids: list[int], start: int = 0) -> np.ndarray[Any, Any]:
        if start or not self.batches_prefills:  # a later chunk: its own shape, after the slot's past
            return super().prefill(slot, ids, start)
        return self.prefill_rows(slot, [ids])[0]  # type: ignore[no-any-return]

    def prefill_rows(self, first: int, prompts: list[list[int]]) -> np.ndarray[Any, Any]:
        """Whole prompts in runs of a few shapes only: rows a power of two, padded to a width of
        :meth:`padded_width`. ONNX Runtime's CUDA provider took 40-75 ms for the first run of
        each new input shape (gpu-125m on an H200, measured alone), where a warm run takes 2-3 ms;
        the few shapes are run once when the engine starts (:meth:`warm`: 1.4 s there)."""
        if not self.batches_prefills:
            return super().prefill_rows(first, prompts)
        runs, done = [], 0
        for rows, width in self.shapes_of([len(p) for p in prompts]):
            runs.append(self.first_prompts(first + done, prompts[done:done + rows], width))
            done += rows
        return np.concatenate(runs)

    def shapes_of(self, lengths: list[int]) -> list[tuple[int, int]]:
        """The (rows, width) of each run :meth:`prefill_rows` makes of whole prompts of
        ``lengths``: the largest power of two of rows left, the next padded width."""
        shapes, done = [], 0
        while done < len(lengths):
            rows = 1 << (len(lengths) - done).bit_length() - 1
            shapes.append((rows, self.padded_width(max(lengths[done:done + rows]))))
            done += rows
        return shapes

    def padded_width(self, longest: int) -> int:
        """The next power of two from :attr:`NARROWEST`, at most the context."""
        return min(max(self.NARROWEST, 1 << (longest - 1).bit_length()), self.shape[3])

    def warm(self, prefill_tokens: int) -> None:
        """Each shape :meth:`prefill_rows` runs within ``prefill_tokens`` a step (one row of any
        width), once, before any sequence takes a slot: on a GPU only (see there). The engine
        groups rows whose longest prompt times their count fits the budget; rounded down to a
        power of two rows and up to a power of two wide, that is within the budget's next power
        of two, or the narrowest width."""
        if self.device.type != "cuda" or not self.batches_prefills:
            return
        for rows, width in self.warm_shapes(prefill_tokens):
            self.first_prompts(0, [[0] * width] * rows, width)
        self.lengths[:] = 0

    def warm_shapes(self, prefill_tokens: int) -> list[tuple[int, int]]:
        """The (rows, width) :meth:`warm` runs."""
        slots, context = self.shape[1], self.shape[3]
        limit = 1 << (max(prefill_tokens, 1) - 1).bit_length()
        shapes = []
        narrowest = self.NARROWEST.bit_length() - 1
        for width in sorted({self.padded_width(1 << n) for n in range(narrowest, context.bit_length() + 1)}):
            rows = 1
            while rows <= slots and (rows == 1 or rows * width <= limit or width == self.NARROWEST):
                shapes.append((rows, width))
                rows *= 2
        return shapes

    def run(self, first: int, end: int, ids: np.ndarray[Any, Any], last: np.ndarray[Any, Any]) -> np.ndarray[Any, Any]:
        torch = self.torch
        logits = torch.empty((end - first, self.vocab), dtype=torch.float32, device=self.device)
        # named: bound by address, they must outlive the run
        ids_there, last_there = torch.from_numpy(ids).to(self.device), torch.from_numpy(last).to(self.device)
        total = total_length(ids, last)
        binding = self.bind(self.session, (ids_there, last_there, total), slice(first, end), logits)
        settle(torch, self.device)
        self.session.run_with_iobinding(binding)
        return logits.cpu().numpy()  # type: ignore[no-any-return]

    def decode_kept(self, slots: list[int], tokens: list[int]) -> Any:
        rows = np.asarray(slots)
        ids, last = self.step_inputs(rows, tokens, len(self.lengths))  # every slot: the graph's shape
        self.step_ids.copy_(self.torch.from_numpy(ids))
        self.step_last.copy_(self.torch.from_numpy(last))
        settle(self.torch, self.device)
        self.step.run_with_iobinding(self.binding)
        self.lengths[rows] += 1
        return self.step_logits.index_select(0, self.torch.from_numpy(rows).to(self.device))

    host = staticmethod(host_rows)
    argmax = staticmethod(argmax_to_host)


class Detokenizer:
    """Token ids to text deltas: none ends inside a UTF-8 character or may be cut by a stop string.
    Incremental (vLLM's prefix and read offsets): a token decodes a short window of ids, not the
    whole sequence again (that cost grew with the sequence, per token). The window starts one
    committed step back, so decoders that change a piece by what precedes it (a word's leading
    space in SentencePiece's Metaspace, WordPiece's ``##``) give the text a whole decode gives."""

    def __init__(self, tokenizer: Any, stops: tuple[str, ...], context: list[int] | None = None) -> None:
        self.tokenizer, self.stops = tokenizer, stops
        # the window opens on the prompt's last token: a first generated word keeps its leading
        # space under Metaspace (Llama 2, Mistral), which a decode of that token alone strips
        self.ids: list[int] = list(context or [])
        self.text = ""  # the text of ids[len(context):read], whole characters
        self.prefix, self.read = 0, len(self.ids)  # the window: ids[prefix:], of which ids[prefix:read] are decoded
        self.sent = 0  # characters of the text already emitted
        self.hold = max((len(s) for s in stops), default=1) - 1

    def pending(self) -> str:
        """The text the ids after ``read`` add to ``text``."""
        window = self.tokenizer.decode(self.ids[self.prefix:])
        return window[len(self.tokenizer.decode(self.ids[self.prefix:self.read])):]

    def add(self, token: int) -> tuple[str, bool]:
        """The text now safe to emit, and whether a stop string ended the text."""
        self.ids.append(token)
        pending = self.pending()
        text = self.text + pending
        whole = bool(pending) and not pending.endswith(REPLACEMENT)  # else inside a UTF-8 character
        if whole:
            self.text, self.prefix, self.read = text, self.read, len(self.ids)
        for stop in self.stops:
            at = text.find(stop, max(0, self.sent - len(stop)))
            if at >= 0:
                return self.flush(text[:at]), True
        if not whole:
            return "", False
        safe = len(text) - self.hold
        if safe <= self.sent:
            return "", False
        delta, self.sent = text[self.sent:safe], safe
        return delta, False

    def flush(self, text: str | None = None) -> str:
        """What is left to emit when the sequence ends."""
        if text is None:
            text = self.text + self.pending()
        delta, self.sent = text[self.sent:], max(self.sent, len(text))
        return delta


@dataclass
class Sequence:
    """One request inside the engine."""

    prompt_ids: list[int]
    params: SamplingParams
    emit: Callable[[Sequence, str, str | None], None]  # (sequence, text delta, finish reason or None)
    cancelled: Callable[[], bool]
    deadline: float
    detok: Detokenizer
    rng: np.random.Generator
    submitted: float = field(default_factory=time.monotonic)
    slot: int = -1
    admitted_at: float = 0.0  # when it took a slot (its prefill starts within the step's budget, oldest first)
    prefilled: int = 0  # prompt tokens in its cache so far (a long prompt takes several engine steps)
    tokens: list[int] = field(default_factory=list)
    first_token_at: float = 0.0
    last_token_at: float = 0.0
    taken: int = 0  # tokens sampled (EOS included)
    finish_reason: str | None = None

    @property
    def decoding(self) -> bool:
        return self.prefilled == len(self.prompt_ids)

    def timings_ms(self) -> tuple[float, float]:
        """Time to first token once admitted (its prefill and first sample) and the mean gap
        between tokens, as the engine saw them: what the version itself did, whatever delays its
        answer on the way to a client. Not the wait for a slot: that measures the other
        sequences' lengths (with every slot taken, a version whose greedy answers run to
        ``max_tokens`` beside a stable that stops at EOS queued its shadow copies 20x longer)."""
        ttft = (self.first_token_at - self.admitted_at) * 1000 if self.first_token_at else float("nan")
        gaps = self.taken - 1
        itl = (self.last_token_at - self.first_token_at) * 1000 / gaps if gaps > 0 else float("nan")
        return ttft, itl


@dataclass
class Stats:
    """What the engine has done, for the server's metrics (read by another thread: plain numbers)."""

    admitted: int = 0
    rejected: int = 0
    cancelled: int = 0
    finished: int = 0
    failed: int = 0
    output_tokens: int = 0
    steps: int = 0
    ttft_s: list[float] = field(default_factory=list)  # drained by the metrics reader
    # each answered request's mean inter-token latency (TGI's mean time per token), not every
    # gap: in Triton each observation the reader makes is a call into the server, and one per
    # token took 9% of the model's process at 8 streams
    itl_s: list[float] = field(default_factory=list)


@dataclass(frozen=True)
class EngineLimits:
    """How much the engine takes on (``serve``): at most ``slots`` sequences decoding at once,
    fewer where their caches would not fit ``kv_cache_bytes`` (0: no budget); ``max_queue``
    requests waiting for a slot (more: :class:`Overloaded`), each ending within
    ``request_timeout_s`` of its submission; a request without ``max_tokens`` gets
    ``default_max_tokens`` (within the context left). ``prefill_tokens``: the prompt tokens one
    engine step prefills before the running sequences' next token (a long prompt goes in chunks,
    so it never stalls the others' streams for longer; 0: every admitted prompt whole)."""

    slots: int
    max_queue: int
    default_max_tokens: int
    request_timeout_s: float
    kv_cache_bytes: int = 0
    prefill_tokens: int = 0

    @classmethod
    def of_config(cls, config: dict[str, Any]) -> EngineLimits:
        """From the engine model's Triton configuration (its ``parameters``, strings: what
        Triton's model.py loads with and what deploy counts before loading); a configuration an
        older export wrote has no cache budget nor prefill budget."""
        params = {key: value["string_value"] for key, value in config.get("parameters", {}).items()}
        return cls(slots=int(params["max_slots"]), max_queue=int(params["max_queue"]),
                   default_max_tokens=int(params["default_max_tokens"]),
                   request_timeout_s=float(params["request_timeout_s"]),
                   kv_cache_bytes=int(params.get("kv_cache_bytes", "0")),
                   prefill_tokens=int(params.get("prefill_tokens", "0")))

    def slots_for(self, shape: CacheShape) -> int:
        """The slots a model of this cache shape gets: as many whole-context caches as the budget
        holds, at most ``slots``; a budget that holds none is refused (the model cannot serve)."""
        if not self.kv_cache_bytes:
            return self.slots
        fits = self.kv_cache_bytes // shape.slot_bytes
        if fits < 1:
            raise ValueError(f"serve.kv_cache_mb {self.kv_cache_bytes / 2**20:g}: one sequence's cache takes "
                             f"{shape.slot_bytes / 2**20:.2f} MiB for this model ({shape.layers} layers, "
                             f"{shape.kv_heads} KV heads of {shape.head_dim}, context {shape.context}): "
                             "raise the budget")
        return int(min(self.slots, fits))


class Engine:
    """The scheduler: a bounded admission queue, ``slots`` running sequences, one thread."""

    def __init__(self, decoder: KVDecoder, tokenizer: Any, context: int, limits: EngineLimits,
                 eos_ids: Iterable[int] = (), bos_id: int | None = None) -> None:
        """``eos_ids``: the ids generation ends at (a checkpoint's; none given: the pipeline's
        ``<|endoftext|>``); ``bos_id``: opens every prompt, for models trained so."""
        self.decoder, self.tokenizer, self.context = decoder, tokenizer, context
        self.slots, self.max_queue = limits.slots, limits.max_queue
        self.default_max_tokens, self.request_timeout_s = limits.default_max_tokens, limits.request_timeout_s
        self.prefill_tokens = limits.prefill_tokens or context * limits.slots  # 0: no bound
        decoder.warm(self.prefill_tokens)
        stops = list(eos_ids) or [tokenizer.token_to_id(EOS)]
        if stops[0] is None:
            raise ValueError(f"the tokenizer has no {EOS} token, and no eos_ids were given")
        self.eos_id: int = stops[0]
        self.eos_ids = frozenset(stops)
        self.prefix = [] if bos_id is None else [bos_id]
        self.queue: collections.deque[Sequence] = collections.deque()
        self.running: dict[int, Sequence] = {}
        self.free = list(range(limits.slots - 1, -1, -1))  # highest first: pop() takes the lowest
        self.wake = threading.Condition()
        self.stopping = False
        self.stats = Stats()
        self._max_prompt_bytes: int | None = None
        self.thread = threading.Thread(target=self.loop, name="engine", daemon=True)

    @classmethod
    def from_folder(cls, folder: str, limits: EngineLimits, threads: int = 0, tensorrt: bool = False,
                    cuda_graph: bool = False) -> Engine:
        """An exported version's folder: decoder.onnx (and decoder_fused.onnx, where the export
        built one), tokenizer.json, generation.json."""
        from tokenizers import Tokenizer

        with open(os.path.join(folder, "generation.json")) as fh:
            shape = json.load(fh)
        cache = CacheShape.of_generation(shape)
        limits = replace(limits, slots=limits.slots_for(cache))
        decoder = KVDecoder.open(os.path.join(folder, "decoder.onnx"), cache, limits.slots, threads, tensorrt,
                                 cuda_graph)
        tokenizer = Tokenizer.from_file(os.path.join(folder, "tokenizer.json"))
        # a checkpoint's special tokens (exports before them: <|endoftext|>, no BOS)
        return cls(decoder, tokenizer, int(shape["seq_len"]), limits, shape.get("eos_ids") or (), shape.get("bos_id"))

    # -- requests -------------------------------------------------------------------------------

    @property
    def max_prompt_bytes(self) -> int:
        """No prompt longer than this fits the context: ``context`` tokens of the vocabulary's
        longest (in UTF-8 bytes, which over-counts byte-level tokens: a safe bound)."""
        if self._max_prompt_bytes is None:
            longest = max((len(token.encode("utf-8")) for token in self.tokenizer.get_vocab()), default=1)
            self._max_prompt_bytes = self.context * max(longest, 4)  # 4: any one character, byte-fallback or not
        return self._max_prompt_bytes

    def encode(self, prompt: str | bytes, framed: bool = True) -> list[int]:
        """A prompt's token ids, opened by the model's BOS where it wants one (``framed``; a
        rendered chat template holds its own); one too long to fit the context is refused by
        its size before it is tokenized (a 16 MB prompt would hold the engine's model thread for
        seconds)."""
        size = len(prompt)  # bytes, or characters: each at least one byte
        if isinstance(prompt, str) and size <= self.max_prompt_bytes:
            size = len(prompt.encode("utf-8", "surrogatepass"))
        if size > self.max_prompt_bytes:
            raise RequestError(f"prompt of {size} bytes cannot fit the model's context of {self.context} tokens "
                               f"(at most {self.max_prompt_bytes} bytes)")
        if isinstance(prompt, bytes):
            try:
                prompt = prompt.decode("utf-8")
            except UnicodeDecodeError as exc:
                raise RequestError(f"prompt is not valid UTF-8 (byte {exc.start})") from None
        ids: list[int] = self.tokenizer.encode(prompt, add_special_tokens=False).ids
        return self.prefix + ids if framed else ids

    def submit(self, prompt_ids: list[int], params: SamplingParams,
               emit: Callable[[Sequence, str, str | None], None],
               cancelled: Callable[[], bool] = lambda: False) -> Sequence:
        """Queue a request (checked already: :func:`check_sampling`); :class:`Overloaded` when full."""
        if not prompt_ids:  # check_sampling refuses it; a sequence without a token would fail its batch
            raise RequestError("prompt is empty")
        rng = np.random.default_rng(params.seed)
        sequence = Sequence(prompt_ids, params, emit, cancelled, time.monotonic() + self.request_timeout_s,
                            Detokenizer(self.tokenizer, params.stop, prompt_ids[-1:]), rng)
        with self.wake:
            if len(self.queue) >= self.max_queue:
                self.stats.rejected += 1
                raise Overloaded(f"server overloaded: {self.max_queue} requests already wait for a slot; retry later")
            self.queue.append(sequence)
            self.wake.notify()
        return sequence

    def start(self) -> Engine:
        self.thread.start()
        return self

    def stop(self) -> None:
        with self.wake:
            self.stopping = True
            self.wake.notify()
        self.thread.join(timeout=30)

    @property
    def queued(self) -> int:
        return len(self.queue)

    @property
    def in_use(self) -> int:
        return len(self.running)

    # -- the loop -------------------------------------------------------------------------------

    def loop(self) -> None:
        while True:
            with self.wake:
                while not self.stopping and not self.queue and not self.running:
                    self.wake.wait()
                if self.stopping:
                    break
                admitted: list[Sequence] = []
                while self.queue and len(admitted) < len(self.free):
                    admitted.append(self.queue.popleft())
            try:
                for sequence in admitted:
                    self.admit(sequence)
                self.drop_abandoned()  # before any prefill: a client gone mid-prompt gets no more chunks
                self.prefill_within_budget()
                if any(s.decoding for s in self.running.values()):
                    self.step()
            except Exception as exc:  # a bug must not stop the engine: its requests fail, the rest go on
                self.fail([*self.running.values(), *(s for s in admitted if s.finish_reason is None
                                                     and s not in self.running.values())], exc)
        for sequence in [*self.running.values(), *self.queue]:
            self.finish(sequence, "abort")

    def admit(self, sequence: Sequence) -> None:
        """A queued request takes a free slot (its prefill starts with the next budget)."""
        if sequence.cancelled():
            self.stats.cancelled += 1
            sequence.finish_reason = "cancelled"
            self.deliver(sequence, "", "cancelled")  # the channel is closed, if still open
            return
        if time.monotonic() > sequence.deadline:  # waited in the queue past the request timeout
            self.finish(sequence, "timeout")
            return
        sequence.slot, sequence.admitted_at = self.free.pop(), time.monotonic()
        self.running[sequence.slot] = sequence
        self.stats.admitted += 1

    def prefill_within_budget(self) -> None:
        """Prompt tokens of the sequences still prefilling, oldest first, ``prefill_tokens`` of
        them this step: a sequence whose prompt is all in takes its first token and decodes from
        the next step on. Whole prompts of consecutive slots go in one run where the decoder
        batches them (:meth:`prefill_group`; padding to the longest counted against the budget,
        not a GPU decoder's further padding to its few shapes). A prompt that
        the whole budget holds goes in whole, the next step where this one has no room left: cut
        at a step's edge, its second part runs after the slot's past, in a shape of its own
        (prompts of 64-128 tokens at 32 streams on an H200: 10.0k output tok/s with such cuts,
        19.1k without; docs/benchmarks.md)."""
        budget = self.prefill_tokens
        waiting = [s for s in self.running.values() if not s.decoding]
        while waiting and budget > 0:
            oldest = waiting[0]
            whole = not oldest.prefilled and len(oldest.prompt_ids) <= self.prefill_tokens
            # a whole prompt waits for a step with room for it; a longer one starts its chunks
            # with a whole budget (chunks of one size: on a GPU each new shape's first run costs)
            starting = not oldest.prefilled and budget < self.prefill_tokens
            if (whole and len(oldest.prompt_ids) > budget) or (not whole and starting):
                return
            group = self.prefill_group(waiting, budget) if whole else [oldest]
            waiting = [s for s in waiting if all(s is not taken for taken in group)]
            if not whole:
                budget -= self.prefill_chunk(oldest, budget)
                continue
            try:
                logits = self.decoder.prefill_rows(group[0].slot, [s.prompt_ids for s in group])
            except Exception as exc:  # the run's requests fail (its ids come from the tokenizer: not one client's input)
                self.fail(group, exc)
                continue
            budget -= len(group) * max(len(s.prompt_ids) for s in group)
            for sequence, row in zip(group, logits, strict=True):
                sequence.prefilled = len(sequence.prompt_ids)
                self.sample_and_take(sequence, row)

    def prefill_group(self, waiting: list[Sequence], budget: int) -> list[Sequence]:
        """The oldest of ``waiting`` (waiting for its whole prompt, which ``budget`` holds), with
        the sequences of the slots next to its (in slot order) that also wait for their whole
        prompt, as many as fit ``budget`` padded to the longest."""
        oldest = waiting[0]
        group = [oldest]
        if not self.decoder.batches_prefills:
            return group
        fresh = {s.slot: s for s in waiting if not s.prefilled}

        def fits(extra: Sequence) -> bool:
            return (len(group) + 1) * max(len(extra.prompt_ids), *(len(s.prompt_ids) for s in group)) <= budget

        while (after := fresh.get(group[-1].slot + 1)) and fits(after):
            group.append(after)
        while (before := fresh.get(group[0].slot - 1)) and fits(before):
            group.insert(0, before)
        return group

    def prefill_chunk(self, sequence: Sequence, budget: int) -> int:
        """The next ``budget`` prompt tokens of ``sequence`` alone; returns how many went in."""
        chunk = sequence.prompt_ids[sequence.prefilled:sequence.prefilled + budget]
        try:
            logits = self.decoder.prefill(sequence.slot, chunk, sequence.prefilled)
        except Exception as exc:  # a failed run fails this request only
            self.fail([sequence], exc)
            return 0
        sequence.prefilled += len(chunk)
        if sequence.decoding:
            self.sample_and_take(sequence, logits)
        return len(chunk)

    def sample_and_take(self, sequence: Sequence, logits: np.ndarray[Any, Any]) -> None:
        try:
            token = sample(logits, sequence.params, sequence.rng)
        except Exception as exc:  # e.g. non-finite logits with temperature > 0: this request only
            self.fail([sequence], exc)
            return
        self.take(sequence, token)

    def step(self) -> None:
        batch = [s for s in self.running.values() if s.decoding]
        greedy = np.fromiter((s.params.greedy for s in batch), bool, len(batch))
        drawing = np.flatnonzero(~greedy)
        try:
            logits = self.decoder.decode_kept([s.slot for s in batch], [s.tokens[-1] for s in batch])
            # greedy rows take their argmax where the logits lie (one call for the batch); only
            # the rows that draw cross to the host whole
            picked = self.decoder.argmax(logits) if greedy.any() else greedy
            drawn = iter(self.decoder.host(logits, drawing) if len(drawing) else ())
        except Exception as exc:
            self.fail(batch, exc)
            return
        self.stats.steps += 1
        for row, sequence in enumerate(batch):
            if greedy[row]:
                self.take(sequence, int(picked[row]))
            else:
                self.sample_and_take(sequence, next(drawn))

    def take(self, sequence: Sequence, token: int) -> None:
        """A new token of ``sequence``: emit its text, or end it (EOS, stop string, max_tokens)."""
        now = time.monotonic()
        if not sequence.first_token_at:
            sequence.first_token_at = now
            self.stats.ttft_s.append(now - sequence.submitted)
        sequence.last_token_at = now
        sequence.taken += 1
        if token in self.eos_ids and not sequence.params.ignore_eos:
            self.finish(sequence, "stop", sequence.detok.flush())  # with the text held back for stop strings
            return
        sequence.tokens.append(token)
        self.stats.output_tokens += 1
        delta, stopped = sequence.detok.add(token)
        if stopped:
            self.finish(sequence, "stop", delta)
        elif len(sequence.tokens) >= sequence.params.max_tokens:
            self.finish(sequence, "length", delta + sequence.detok.flush())
        elif delta:
            self.deliver(sequence, delta, None)

    def deliver(self, sequence: Sequence, delta: str, reason: str | None) -> None:
        try:
            sequence.emit(sequence, delta, reason)
        except Exception:  # the client's channel is gone: free its slot and end the request
            if reason is None:
                self.stats.cancelled += 1
                self.release(sequence, "cancelled")
                with contextlib.suppress(Exception):
                    sequence.emit(sequence, "", "cancelled")

    def finish(self, sequence: Sequence, reason: str, delta: str = "") -> None:
        self.release(sequence, reason)
        self.stats.finished += 1
        if reason in ("stop", "length") and math.isfinite(itl_ms := sequence.timings_ms()[1]):
            self.stats.itl_s.append(itl_ms / 1000)
        self.deliver(sequence, delta, reason)

    def release(self, sequence: Sequence, reason: str) -> None:
        sequence.finish_reason = reason
        if self.running.pop(sequence.slot, None) is sequence:
            bisect.insort(self.free, sequence.slot, key=lambda slot: -slot)  # the lowest slot taken next

    def fail(self, batch: list[Sequence], exc: Exception) -> None:
        message = f"generation failed: {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
        for sequence in batch:
            self.release(sequence, "error")
            self.stats.failed += 1
            self.deliver(sequence, message, "error")

    def drop_abandoned(self) -> None:
        """Free the slots of clients that went away or waited past the request timeout."""
        now = time.monotonic()
        for sequence in list(self.running.values()):
            if sequence.cancelled():
                self.stats.cancelled += 1
                self.release(sequence, "cancelled")
                self.deliver(sequence, "", "cancelled")
            elif now > sequence.deadline:
                self.finish(sequence, "timeout")


TEXT_ENDS = (None, "stop", "length")  # a delta, or an end that carries text


class Outbox:
    """What the engine emits, sent off its thread and coalesced. The engine's callback only
    queues a sequence's text delta (or its end); a thread of its own hands each sequence's queued
    text to that sequence's ``send`` in order, as one piece: while one send runs (in Triton, a
    response through the stub's IPC to the server, ~1 ms at concurrency 8) the engine keeps
    stepping, and the tokens a sequence gained meanwhile go out together. At low load that is one
    send per token; under load fewer, larger ones, never a delta reordered or lost. A send that
    raises marks its sequence gone (``gone``): the engine's cancellation check reads that."""

    def __init__(self) -> None:
        self.queued: dict[int, tuple[Sequence, Callable[[Sequence, str, str | None], None], str, str | None]] = {}
        self.failed: set[int] = set()
        self.wake = threading.Condition()
        self.closing = False
        self.thread = threading.Thread(target=self.loop, name="outbox", daemon=True)
        self.thread.start()

    def put(self, sequence: Sequence, delta: str, reason: str | None,
            send: Callable[[Sequence, str, str | None], None]) -> None:
        with self.wake:
            _, _, text, _ = self.queued.get(id(sequence), (sequence, send, "", None))
            # an end with text (stop, length) carries what was queued before it; an error, a
            # timeout or a cancellation ends the stream with its own message
            self.queued[id(sequence)] = (sequence, send, text + delta if reason in TEXT_ENDS else delta, reason)
            self.wake.notify()

    def gone(self, sequence: Sequence) -> bool:
        return id(sequence) in self.failed

    def loop(self) -> None:
        while True:
            with self.wake:
                while not self.queued and not self.closing:
                    self.wake.wait()
                if not self.queued:  # closing, all sent
                    return
                batch, self.queued = self.queued, {}
            for key, (sequence, send, text, reason) in batch.items():
                try:
                    send(sequence, text, reason)
                except Exception:  # the client's channel is gone: the engine frees its slot
                    self.failed.add(key)
                if reason is not None:
                    self.failed.discard(key)  # ended: its id may be reused

    def close(self, timeout_s: float = 30.0) -> None:
        """Send what is queued, then stop."""
        with self.wake:
            self.closing = True
            self.wake.notify()
        self.thread.join(timeout_s)


def generate(engine: Engine, prompt_ids: list[int], params: SamplingParams, timeout_s: float = 60.0) -> Sequence:
    """One request through a started engine, waiting for its end (tests, parity, benchmarks)."""
    done = threading.Event()

    def emit(sequence: Sequence, delta: str, reason: str | None) -> None:
        if reason is not None:
            done.set()

    sequence = engine.submit(prompt_ids, params, emit)
    if not done.wait(timeout_s):
        raise TimeoutError(f"no answer in {timeout_s}s")
    return sequence
