"""Triton python backend, decoupled: text in, tokens streamed out, by the engine beside this file.

``execute`` only checks each request and hands it to :class:`engine.Engine` (continuous batching
over the KV-cache decoder); the engine's thread sends the responses through each request's
response sender: a response per text delta when the request asks ``stream`` (Triton's
``generate_stream`` SSE and gRPC streams), else one response with the whole text. Every request
ends with a final flag. A bad request gets its own INVALID_ARG error (HTTP 400) and never
reaches the batch; a full admission queue answers UNAVAILABLE at once (the OpenAI front turns it
into 429). Inputs follow Triton's LLM backends' names (``text_input``, ``max_tokens``,
``stream``, sampling values as optional scalars), so ``/v2/models/llm_generate/generate`` works
with a plain JSON body.

Metrics on Triton's endpoint (:8002/metrics), labelled by model and version, published every
half second: time to first token and inter-token latency (histograms), output tokens, slots in
use and held (the KV cache's size in sequences), queue length, rejected and cancelled requests.
"""

from __future__ import annotations

import json
import math
import os
import sys
import threading
import time
from typing import Any

import numpy as np
import triton_python_backend_utils as pb_utils

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from engine import Engine, EngineLimits, Outbox, Overloaded, RequestError, SamplingRequest, Sequence, check_sampling

CHAT_CONFIG = "tokenizer_config.json"  # a base's, exported beside the engine: its chat template

FINAL = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL
METRICS_PERIOD_S = 0.5  # how stale Triton's engine metrics may be
# how often a running request asks Triton whether its client went away: each ask is a round trip
# to the server process, and asked for every sequence at every engine step they took a fifth of
# the engine thread's time at 8 streams (py-spy, docs/benchmarks.md). 10 ms: a short generation
# (60 tokens of a small model take ~60 ms) still learns of its client's disconnect mid-stream
CANCEL_POLL_S = 0.01
LATENCY_BUCKETS = [0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0]
SCALARS = {"max_tokens": int, "temperature": float, "top_k": int, "top_p": float, "seed": int}


def scalar(request: Any, name: str) -> Any:
    tensor = pb_utils.get_input_tensor_by_name(request, name)
    if tensor is None:
        return None
    value = tensor.as_numpy().reshape(-1)
    if value.size != 1:
        raise RequestError(f"{name}: expected one value, got {value.size}")
    item = value[0]
    return item.decode("utf-8", errors="replace") if isinstance(item, bytes) else item.item()


def chat_template(folder: str) -> Any:
    """The model's own chat template (chat.py, exported beside the engine with the base's
    tokenizer_config.json), or None: a model without one answers chat with the front's plain template."""
    path = os.path.join(folder, CHAT_CONFIG)
    if not os.path.exists(path):
        return None
    from chat import ChatTemplate

    with open(path, encoding="utf-8") as fh:
        template = ChatTemplate.from_tokenizer_config(json.load(fh))
    return None if template.plain else template


def chat_messages(request: Any) -> list[dict[str, Any]] | None:
    """The request's chat messages (the front's ``messages`` request parameter, a JSON list), if any."""
    try:
        parameters = json.loads(request.parameters() or "{}")
    except (json.JSONDecodeError, TypeError):
        return None
    value = parameters.get("messages") if isinstance(parameters, dict) else None
    if not isinstance(value, str):
        return None
    try:
        messages = json.loads(value)
    except json.JSONDecodeError:
        raise RequestError("messages: not a JSON list of messages") from None
    if not isinstance(messages, list) or not all(isinstance(m, dict) for m in messages):
        raise RequestError("messages: not a JSON list of messages")
    return messages


def stop_strings(request: Any) -> list[str] | None:
    """``stop``: one string, or a JSON list of strings in one string."""
    value = scalar(request, "stop")
    if value is None or value == "":
        return None
    if isinstance(value, str) and value.startswith("["):
        try:
            stops = json.loads(value)
        except json.JSONDecodeError:
            raise RequestError(f"stop {value[:40]!r}: not a JSON list of strings") from None
        return stops if isinstance(stops, list) else [value]
    return [str(value)]


class Metrics:
    """The engine's figures as Triton custom metrics (published by TritonPythonModel.publish_metrics)."""

    def __init__(self, model: str, version: str) -> None:
        labels = {"model": model, "version": version}
        self.families: list[Any] = []  # a family must outlive its metrics: kept here

        def family(name: str, text: str, kind: Any) -> Any:
            self.families.append(pb_utils.MetricFamily(name=name, description=text, kind=kind))
            return self.families[-1]

        histogram = getattr(pb_utils.MetricFamily, "HISTOGRAM", None)
        counter, gauge = pb_utils.MetricFamily.COUNTER, pb_utils.MetricFamily.GAUGE
        self.lock = threading.Lock()
        self.latency: dict[str, Any] = {}
        if histogram is not None:
            for key, name, text in (("ttft", "llm_ttft_seconds", "time to first token (s)"),
                                    ("itl", "llm_request_itl_seconds", "a request's mean inter-token latency (s)")):
                self.latency[key] = family(name, text, histogram).Metric(labels=labels, buckets=LATENCY_BUCKETS)
        self.counters = {key: family(f"llm_{key}_total", text, counter).Metric(labels=labels) for key, text in (
            ("output_tokens", "tokens generated"), ("requests_rejected", "requests refused: queue full"),
            ("requests_cancelled", "requests whose client went away or timed out"),
            ("requests_finished", "requests answered to the end"), ("requests_failed", "requests failed by the engine"))}
        self.gauges = {key: family(f"llm_{key}", text, gauge).Metric(labels=labels) for key, text in (
            ("slots_in_use", "sequences in the running batch"), ("queue_length", "requests waiting for a slot"),
            ("slots", "sequences the KV cache holds (serve.kv_cache_mb, at most serve.max_slots)"))}
        self.seen = {key: 0 for key in self.counters}

    def refresh(self, engine: Engine) -> None:
        stats = engine.stats
        with self.lock:
            totals = {"output_tokens": stats.output_tokens, "requests_rejected": stats.rejected,
                      "requests_cancelled": stats.cancelled, "requests_finished": stats.finished,
                      "requests_failed": stats.failed}
            for key, total in totals.items():
                if total > self.seen[key]:
                    self.counters[key].increment(total - self.seen[key])
                    self.seen[key] = total
            self.gauges["slots_in_use"].set(engine.in_use)
            self.gauges["slots"].set(engine.slots)
            self.gauges["queue_length"].set(engine.queued)
            for key, values in (("ttft", stats.ttft_s), ("itl", stats.itl_s)):
                drained = values[:]
                del values[:len(drained)]
                if key in self.latency:
                    for value in drained:
                        self.latency[key].observe(value)


class TritonPythonModel:
    def initialize(self, args: dict[str, Any]) -> None:
        folder = os.path.join(args["model_repository"], args["model_version"])
        config = json.loads(args["model_config"])
        if not pb_utils.using_decoupled_model_transaction_policy(config):
            raise pb_utils.TritonModelException("llm_generate must be decoupled (model_transaction_policy)")
        params = {k: v["string_value"] for k, v in config.get("parameters", {}).items()}
        self.engine = Engine.from_folder(folder, EngineLimits.of_config(config),
                                         threads=int(params.get("intra_op_thread_count", "0")),
                                         tensorrt=params.get("tensorrt") == "true",
                                         cuda_graph=params.get("cuda_graph") == "true")
        # the engine's timings go out only where the configuration declares them (a version's
        # model.py may run under a configuration an older export wrote)
        outputs = {output["name"] for output in config.get("output", [])}
        self.timed = {"engine_ttft_ms", "engine_itl_ms"} <= outputs
        self.chat = chat_template(folder)
        self.metrics = Metrics(args["model_name"], args["model_version"])
        self.outbox = Outbox()  # responses sent off the engine's thread, coalesced under load
        self.engine.start()
        self.stopped = threading.Event()
        self.publisher = threading.Thread(target=self.publish_metrics, name="metrics", daemon=True)
        self.publisher.start()

    def execute(self, requests: list[Any]) -> None:
        for request in requests:
            sender = request.get_response_sender()
            try:
                prompt_ids, params, stream = self.parse(request)
                emit, cancelled = self.emitter(sender, stream, len(prompt_ids))
                self.engine.submit(prompt_ids, params, emit, cancelled=cancelled)
            except RequestError as exc:
                sender.send(pb_utils.InferenceResponse(error=pb_utils.TritonError(str(exc), pb_utils.TritonError.INVALID_ARG)),
                            flags=FINAL)
            except Overloaded as exc:
                sender.send(pb_utils.InferenceResponse(error=pb_utils.TritonError(str(exc), pb_utils.TritonError.UNAVAILABLE)),
                            flags=FINAL)
            except Exception as exc:  # a bug fails this request alone, with its final flag
                message = f"generation failed: {type(exc).__name__}: {exc}".splitlines()[0]
                try:
                    sender.send(pb_utils.InferenceResponse(error=pb_utils.TritonError(message)), flags=FINAL)
                except Exception as lost:  # its channel is gone too: say so in the server's log
                    pb_utils.Logger.log_error(f"llm_generate: {message}; not sent: {lost}")
        return None

    def publish_metrics(self) -> None:
        """The engine's figures to Triton's metrics every METRICS_PERIOD_S, on a thread of their
        own: each metric update is a call to the server process, and made by the engine thread
        when a request ended (one per inter-token gap) they held up every other sequence's next
        token."""
        while not self.stopped.wait(METRICS_PERIOD_S):
            self.refresh_metrics()
        self.refresh_metrics()

    def refresh_metrics(self) -> None:
        try:
            self.metrics.refresh(self.engine)
        except Exception as exc:  # figures are not worth a request: say so in the server's log
            pb_utils.Logger.log_error(f"llm_generate metrics: {type(exc).__name__}: {exc}")

    def parse(self, request: Any) -> tuple[list[int], Any, bool]:
        """A request's prompt ids, sampling and whether it streams. With chat ``messages`` and a
        template of its own, the model renders them as transformers would (its special tokens
        are in the text: nothing is added) and the plain template's stop, which the front sends
        for models without one, is dropped; else ``text_input`` is the prompt."""
        text = pb_utils.get_input_tensor_by_name(request, "text_input")
        if text is None:
            raise RequestError("text_input is missing")
        values = text.as_numpy().reshape(-1)
        if values.size != 1:
            raise RequestError(f"text_input: expected one prompt, got {values.size}")
        messages = chat_messages(request) if self.chat is not None else None
        stops = stop_strings(request)
        if messages is not None:
            from chat import TemplateError, without_plain_stop

            try:
                prompt_ids = self.engine.encode(self.chat.render(messages), framed=False)
            except TemplateError as exc:
                raise RequestError(str(exc)) from None
            stops = without_plain_stop(stops) if stops else stops
        else:
            prompt_ids = self.engine.encode(values[0])
        settings = {}
        for name, kind in SCALARS.items():
            value = scalar(request, name)
            try:
                settings[name] = None if value is None else kind(value)
            except (TypeError, ValueError):
                raise RequestError(f"{name} {value!r}: expected a number") from None
        asked = SamplingRequest(stop=stops, ignore_eos=bool(scalar(request, "ignore_eos")), **settings)
        params = check_sampling(asked, default_max_tokens=self.engine.default_max_tokens,
                                prompt_tokens=len(prompt_ids), context=self.engine.context)
        return prompt_ids, params, bool(scalar(request, "stream"))

    def emitter(self, sender: Any, stream: bool, prompt_tokens: int) -> tuple[Any, Any]:
        """The engine's callback for one request, which queues its text in the outbox (streamed
        deltas; otherwise the whole text at the end), and its cancellation check (Triton cancelled
        it, or a send through its sender failed): the outbox's thread sends the responses."""
        pieces: list[str] = []
        sent: list[Sequence] = []

        def response(text: str, reason: str, sequence: Sequence) -> Any:
            # a delta carries its text alone: each tensor is a block of shared memory the stub
            # fills and the server reads, per token (the counts and timings come with the end)
            tensors = [pb_utils.Tensor("text_output", np.asarray([text.encode()], dtype=object))]
            if not reason:
                return pb_utils.InferenceResponse(output_tensors=tensors)
            tensors += [
                pb_utils.Tensor("finish_reason", np.asarray([reason.encode()], dtype=object)),
                pb_utils.Tensor("prompt_tokens", np.asarray([prompt_tokens], dtype=np.int32)),
                pb_utils.Tensor("completion_tokens", np.asarray([len(sequence.tokens)], dtype=np.int32))]
            if self.timed:  # the final response: the engine's own timings (NaN is not JSON: -1)
                tensors += [pb_utils.Tensor(name, np.asarray([value if math.isfinite(value) else -1.0], dtype=np.float32))
                            for name, value in zip(("engine_ttft_ms", "engine_itl_ms"), sequence.timings_ms(), strict=True)]
            return pb_utils.InferenceResponse(output_tensors=tensors)

        def send(sequence: Sequence, delta: str, reason: str | None) -> None:
            if reason is None:
                sender.send(response(delta, "", sequence))
            elif reason in ("error", "timeout"):
                message = delta if reason == "error" else f"request timed out after {self.engine.request_timeout_s:g}s"
                sender.send(pb_utils.InferenceResponse(error=pb_utils.TritonError(message)), flags=FINAL)
            elif reason == "cancelled" or reason == "abort":
                sender.send(flags=FINAL)
            else:
                sender.send(response(delta, reason, sequence), flags=FINAL)

        def emit(sequence: Sequence, delta: str, reason: str | None) -> None:
            if not sent:
                sent.append(sequence)
            if reason is None and not stream:
                pieces.append(delta)
                return
            text = delta if stream or reason in ("error", "timeout") else "".join(pieces) + delta
            self.outbox.put(sequence, text, reason, send)

        asked_at = [-math.inf]

        def cancelled() -> bool:
            if sent and self.outbox.gone(sent[0]):
                return True
            now = time.monotonic()
            if now - asked_at[0] < CANCEL_POLL_S:
                return False
            asked_at[0] = now
            return bool(sender.is_cancelled())

        return emit, cancelled

    def finalize(self) -> None:
        self.engine.stop()
        self.outbox.close()
        self.stopped.set()
        self.publisher.join(timeout=10)
