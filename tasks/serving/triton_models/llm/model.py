"""Triton python backend: next-token logits of the exported ONNX model, run by ONNX Runtime.

Dynamic batching hands ``execute`` several requests at once; requests of the same sequence
length are stacked into one ONNX Runtime call (that is what batching buys on a CPU).

One request never fails another: each is checked before it joins a batch (token ids within the
vocabulary, a length within the context) and a bad one is answered alone, INVALID_ARG (HTTP 400)
with a one-line reason; if a stacked call still fails, its requests run again one by one so only
the culprit gets the error.
"""

from __future__ import annotations

import json
import os
from typing import Any

import numpy as np
import onnxruntime as ort
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def initialize(self, args: dict[str, Any]) -> None:
        folder = os.path.join(args["model_repository"], args["model_version"])
        config = json.loads(args["model_config"])
        options = ort.SessionOptions()
        # serve.intra_op_threads (0: ONNX Runtime's default, every core): a batch of requests is
        # one bigger call, which is what lets more threads pay off
        threads = config.get("parameters", {}).get("intra_op_thread_count", {}).get("string_value", "0")
        options.intra_op_num_threads = int(threads)
        options.add_session_config_entry("session.intra_op.allow_spinning", "0")  # cores are shared (engine.py)
        self.session = ort.InferenceSession(os.path.join(folder, "model.onnx"), options,
                                            providers=["CPUExecutionProvider"])
        self.max_batch = max(int(config.get("max_batch_size", 1)), 1)
        self.vocab_size, self.context = self.shape(folder)

    def shape(self, folder: str) -> tuple[int, int | None]:
        """``(vocab size, context)`` from the export's ``model.json``; an export written before it
        had one: the vocabulary from one token's logits, no length bound (a too long request then
        fails alone, by the one-by-one rerun)."""
        path = os.path.join(folder, "model.json")
        if os.path.exists(path):
            with open(path) as fh:
                shape = json.load(fh)
            return int(shape["vocab_size"]), int(shape["seq_len"])
        logits = self.session.run(["logits"], {"input_ids": np.zeros((1, 1), np.int64)})[0]
        return int(logits.shape[-1]), None

    def problem(self, ids: np.ndarray[Any, Any]) -> str:
        """Why this request cannot run (one line), or ""."""
        if ids.ndim != 2 or ids.shape[1] == 0:
            return f"input_ids: expected (batch, tokens) with at least one token, got shape {list(ids.shape)}"
        if self.context is not None and ids.shape[1] > self.context:
            return f"input_ids: {ids.shape[1]} tokens, more than the model's context of {self.context}"
        outside = ids[(ids < 0) | (ids >= self.vocab_size)]
        if outside.size:
            return f"input_ids: token id {int(outside[0])} outside the vocabulary [0, {self.vocab_size})"
        return ""

    def run(self, stacked: np.ndarray[Any, Any]) -> tuple[np.ndarray[Any, Any], np.ndarray[Any, Any]]:
        logits, next_token = self.session.run(["logits", "next_token"], {"input_ids": stacked})
        return logits.astype(np.float32), next_token.astype(np.int64)

    def execute(self, requests: list[Any]) -> list[Any]:
        responses: list[Any] = [None] * len(requests)
        by_length: dict[int, list[tuple[int, np.ndarray[Any, Any]]]] = {}
        for index, request in enumerate(requests):
            ids = pb_utils.get_input_tensor_by_name(request, "input_ids").as_numpy().astype(np.int64)
            problem = self.problem(ids)
            if problem:
                responses[index] = error_response(problem, pb_utils.TritonError.INVALID_ARG)
            else:
                by_length.setdefault(ids.shape[1], []).append((index, ids))
        for group in by_length.values():
            try:
                outputs = self.run(np.concatenate([ids for _, ids in group]))
            except Exception:  # one of them broke the call: find which, alone
                for index, ids in group:
                    responses[index] = self.respond_alone(ids)
                continue
            row = 0
            for index, ids in group:
                rows = ids.shape[0]
                responses[index] = logits_response(outputs[0][row:row + rows], outputs[1][row:row + rows])
                row += rows
        return responses

    def respond_alone(self, ids: np.ndarray[Any, Any]) -> Any:
        try:
            return logits_response(*self.run(ids))
        except Exception as exc:  # this request's own failure, answered to it alone
            reason = " ".join(str(exc).split())[:300]
            return error_response(f"input_ids: the model failed on this request ({reason})",
                                  pb_utils.TritonError.INTERNAL)


def logits_response(logits: np.ndarray[Any, Any], next_token: np.ndarray[Any, Any]) -> Any:
    return pb_utils.InferenceResponse([pb_utils.Tensor("logits", logits), pb_utils.Tensor("next_token", next_token)])


def error_response(message: str, code: Any) -> Any:
    return pb_utils.InferenceResponse(error=pb_utils.TritonError(message, code))
