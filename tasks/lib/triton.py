"""Triton Inference Server: model configurations from one source, and a small HTTP client.

One function builds each served model's configuration as a dict (Triton's ``ModelConfig`` in
its protobuf JSON form, checked against Triton's own ``model_config.proto``); :func:`to_pbtxt`
writes it as ``config.pbtxt`` for a model repository, and the JSON form goes to Triton's load API
as a config override (that is how a
deploy picks which versions are loaded). Backends:

- ``python``: Triton's python backend running ONNX Runtime on ``model.onnx``
  (``tasks/serving/triton_models/llm/model.py``): the only backend of the tritonserver that installs on
  these machines (PyTriton's wheel).
- ``onnxruntime_onnx``: the same ``model.onnx`` on Triton's ONNX Runtime backend (NVIDIA's
  tritonserver image, CPU or GPU).
- ``tensorrt_plan``: the FP16 engine the export step builds where it runs on a GPU with the
  tensorrt package (not in the DAG: its export runs on the cpu kind).

Served models: ``llm`` (token ids -> next-token logits and the greedy next token) and
``llm_generate`` (text in, text out or streamed: the generation engine, continuous batching over
the KV-cache decoder ``decoder.onnx``).
"""

from __future__ import annotations

import json
import re
import urllib.error
import urllib.request
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from tasks.config import ServeSettings
from tasks.lib.errors import StepError
from tasks.lib.polling import wait_until

BACKENDS = ("python", "onnxruntime_onnx", "tensorrt_plan")
MODEL_FILES = {"python": "model.onnx", "onnxruntime_onnx": "model.onnx", "tensorrt_plan": "model.plan"}
TIMING_OUTPUTS = ("engine_ttft_ms", "engine_itl_ms")  # llm_generate's own timings (model.py)


def logits_model_config(name: str, backend: str, serve: ServeSettings, gpu: bool = False) -> dict[str, Any]:
    """``llm``: ``input_ids`` (batch, time) -> ``logits`` (batch, vocab) of the next token and
    ``next_token`` (batch, 1). The vocabulary axis is left dynamic so versions trained with
    different tokenizers can be served side by side under one configuration."""
    if backend not in BACKENDS:
        raise StepError(f"serve.backend {backend!r}: expected one of {', '.join(BACKENDS)}")
    if backend == "tensorrt_plan" and not gpu:
        raise StepError("serve.backend tensorrt_plan needs the gpu kind")
    config: dict[str, Any] = {
        "name": name,
        "max_batch_size": serve.max_batch_size,
        "input": [{"name": "input_ids", "data_type": "TYPE_INT64", "dims": [-1]}],
        "output": [
            {"name": "logits", "data_type": "TYPE_FP32", "dims": [-1]},
            {"name": "next_token", "data_type": "TYPE_INT64", "dims": [1]},
        ],
        "dynamic_batching": {
            "preferred_batch_size": list(serve.preferred_batch_sizes),
            "max_queue_delay_microseconds": serve.max_queue_delay_us,
            # overload is a fast refusal (HTTP 503), not a queue that grows until clients time out
            "default_queue_policy": {"max_queue_size": serve.queue.max_size, "timeout_action": "REJECT",
                                     "default_timeout_microseconds": serve.queue.timeout_ms * 1000},
        },
        "instance_group": [{"count": serve.instances, "kind": "KIND_GPU" if gpu else "KIND_CPU"}],
    }
    if not gpu:  # the ONNX Runtime backend's own parameter; the python backend's model reads it too
        config["parameters"] = {"intra_op_thread_count": {"string_value": str(serve.intra_op_threads)}}
    if backend == "python":
        config["backend"] = "python"
    else:
        config["platform"] = backend
        config["default_model_filename"] = MODEL_FILES[backend]
    return config


def generate_model_config(name: str, serve: ServeSettings) -> dict[str, Any]:
    """``llm_generate``: text in, text out or streamed (python backend, decoupled): the engine of
    ``tasks/serving/triton_models/llm_generate`` (continuous batching over the KV-cache decoder). Inputs
    follow Triton's LLM backends (``text_input``, ``max_tokens``, ``stream``, sampling scalars)."""
    generate = serve.generate
    optional = [("max_tokens", "TYPE_INT32"), ("temperature", "TYPE_FP32"), ("top_k", "TYPE_INT32"),
                ("top_p", "TYPE_FP32"), ("seed", "TYPE_INT64"), ("stop", "TYPE_STRING"), ("stream", "TYPE_BOOL"),
                ("ignore_eos", "TYPE_BOOL")]
    return {
        "name": name,
        "backend": "python",
        "max_batch_size": 0,
        "model_transaction_policy": {"decoupled": True},
        "input": [{"name": "text_input", "data_type": "TYPE_STRING", "dims": [1]},
                  *({"name": n, "data_type": t, "dims": [1], "optional": True} for n, t in optional)],
        "output": [{"name": "text_output", "data_type": "TYPE_STRING", "dims": [1]},
                   {"name": "finish_reason", "data_type": "TYPE_STRING", "dims": [1]},
                   {"name": "prompt_tokens", "data_type": "TYPE_INT32", "dims": [1]},
                   {"name": "completion_tokens", "data_type": "TYPE_INT32", "dims": [1]},
                   # on the final response: the engine's own time to first token (from taking a
                   # slot) and mean gap between tokens (ms), which the shadow's judge compares
                   *({"name": n, "data_type": "TYPE_FP32", "dims": [1]} for n in TIMING_OUTPUTS)],
        "instance_group": [{"count": 1, "kind": "KIND_CPU"}],  # the engine batches: one instance
        "parameters": {
            "max_slots": {"string_value": str(serve.max_slots)},
            "kv_cache_bytes": {"string_value": str(int(serve.kv_cache_mb * 2**20))},
            "prefill_tokens": {"string_value": str(generate.prefill_tokens)},
            "max_queue": {"string_value": str(generate.max_queue)},
            "default_max_tokens": {"string_value": str(generate.max_tokens)},
            "request_timeout_s": {"string_value": str(generate.request_timeout_s)},
            "tensorrt": {"string_value": str(generate.tensorrt).lower()},
            "cuda_graph": {"string_value": str(generate.cuda_graph).lower()},
            "intra_op_thread_count": {"string_value": str(serve.intra_op_threads)},
        },
    }


def with_versions(config: Mapping[str, Any], versions: Sequence[int]) -> dict[str, Any]:
    """The configuration that makes Triton serve exactly ``versions`` (explicit model control)."""
    return {**config, "version_policy": {"specific": {"versions": sorted(int(v) for v in versions)}}}


def model_config(config: Mapping[str, Any]) -> Any:
    """The dict as Triton's own ``ModelConfig`` protobuf (tritonclient ships it): a field Triton
    does not have, or a value of the wrong type, is refused here rather than by the server."""
    from google.protobuf import json_format
    from tritonclient.grpc import model_config_pb2

    try:
        return json_format.ParseDict(config, model_config_pb2.ModelConfig())
    except json_format.ParseError as exc:
        raise ValueError(f"model config {config.get('name')!r}: {exc}") from None


def to_pbtxt(config: Mapping[str, Any]) -> str:
    """A ModelConfig dict in protobuf text format (``config.pbtxt``), written by protobuf."""
    from google.protobuf import text_format

    return str(text_format.MessageToString(model_config(config)))


class TritonClient:
    """Triton's HTTP/REST API (KServe v2 + repository extension), stdlib only."""

    def __init__(self, url: str, timeout_s: float = 30.0) -> None:
        self.url = url.rstrip("/")
        self.timeout_s = timeout_s

    def _call(self, method: str, path: str, body: Any = None) -> tuple[int, bytes]:
        data = None if body is None else json.dumps(body).encode()
        request = urllib.request.Request(self.url + path, data=data, method=method,
                                         headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(request, timeout=self.timeout_s) as resp:
                return resp.status, resp.read()
        except urllib.error.HTTPError as exc:
            return exc.code, exc.read()

    def server_ready(self) -> bool:
        try:
            return self._call("GET", "/v2/health/ready")[0] == 200
        except OSError:
            return False

    def model_ready(self, name: str, version: int) -> bool:
        return self._call("GET", f"/v2/models/{name}/versions/{version}/ready")[0] == 200

    def load(self, name: str, config: Mapping[str, Any]) -> None:
        """Load (or reload) ``name`` with this configuration; Triton loads and unloads versions
        to match its version policy, keeping the versions that stay loaded serving."""
        model_config(config)  # a field Triton does not have: refused here, naming it
        status, body = self._call("POST", f"/v2/repository/models/{name}/load",
                                  {"parameters": {"config": json.dumps(config)}})
        if status != 200:
            raise StepError(f"triton {self.url}: loading {name} failed ({status}): {_error(body)}")

    def unload(self, name: str) -> None:
        status, body = self._call("POST", f"/v2/repository/models/{name}/unload", {})
        if status != 200:
            raise StepError(f"triton {self.url}: unloading {name} failed ({status}): {_error(body)}")

    def wait_ready(self, name: str, versions: Sequence[int], timeout_s: float) -> None:
        wait_until(lambda: all(self.model_ready(name, v) for v in versions), timeout_s, 0.2, lambda: StepError(
            f"triton {self.url}: {name} versions {list(versions)} not ready after {timeout_s:.0f}s"))

    def loaded_versions(self, name: str) -> list[int]:
        status, body = self._call("POST", "/v2/repository/index", {"ready": True})
        if status != 200:
            raise StepError(f"triton {self.url}: repository index failed ({status})")
        return sorted(int(m["version"]) for m in json.loads(body) if m.get("name") == name and m.get("version"))


def _error(body: bytes) -> str:
    try:
        return str(json.loads(body).get("error", body[:300]))
    except ValueError:
        return body[:300].decode(errors="replace")


# -- inference over HTTP (used through the router too) ---------------------------------------


def infer_path(model: str, version: int | None = None) -> str:
    """The KServe v2 infer path of ``model``: of one version, else whichever the server (or
    the router in front of it) picks."""
    return f"/v2/models/{model}/versions/{version}/infer" if version is not None else f"/v2/models/{model}/infer"


def infer_request(input_ids: np.ndarray[Any, Any]) -> bytes:
    """A KServe v2 infer body: token ids as JSON, logits asked back as binary data."""
    return json.dumps({
        "inputs": [{"name": "input_ids", "datatype": "INT64", "shape": list(input_ids.shape),
                    "data": input_ids.reshape(-1).tolist()}],
        "outputs": [{"name": "logits", "parameters": {"binary_data": True}}, {"name": "next_token"}],
    }).encode()


def parse_infer_response(body: bytes, header_length: int | None) -> tuple[np.ndarray[Any, Any], np.ndarray[Any, Any]]:
    """(logits (batch, vocab) float32, next_token (batch,) int64) of an infer response."""
    head = json.loads(body[:header_length] if header_length else body)
    binary = body[header_length:] if header_length else b""
    outputs: dict[str, np.ndarray[Any, Any]] = {}
    offset = 0
    for out in head["outputs"]:
        size = out.get("parameters", {}).get("binary_data_size")
        if size is not None:
            outputs[out["name"]] = np.frombuffer(binary[offset:offset + size], dtype=np.float32).reshape(out["shape"])
            offset += size
        else:
            outputs[out["name"]] = np.asarray(out["data"]).reshape(out["shape"])
    return outputs["logits"], outputs["next_token"].reshape(-1).astype(np.int64)


def version_counters(metrics_text: str, model: str) -> dict[int, dict[str, float]]:
    """Per-version request counters of ``model`` from Triton's Prometheus metrics (:8002)."""
    wanted = {"nv_inference_request_success": "success", "nv_inference_request_failure": "failure",
              "nv_inference_request_duration_us": "duration_us", "nv_inference_queue_duration_us": "queue_us",
              "nv_inference_compute_infer_duration_us": "compute_us",
              "nv_inference_compute_input_duration_us": "compute_input_us",
              "nv_inference_compute_output_duration_us": "compute_output_us",
              "nv_inference_exec_count": "executions", "nv_inference_count": "inferences"}
    found: dict[int, dict[str, float]] = {}
    pattern = re.compile(r'^(\w+)\{([^}]*)\}\s+([0-9.eE+-]+)$')
    for line in metrics_text.splitlines():
        match = pattern.match(line)
        if not match or match.group(1) not in wanted:
            continue
        labels = dict(re.findall(r'(\w+)="([^"]*)"', match.group(2)))
        if labels.get("model") != model or not labels.get("version", "").isdigit():
            continue
        entry = found.setdefault(int(labels["version"]), {})
        key = wanted[match.group(1)]  # failures come one line per reason: summed
        entry[key] = entry.get(key, 0.0) + float(match.group(3))
    return found
