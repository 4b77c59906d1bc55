"""Triton python backend: next-token logits of the exported ONNX model, run by ONNX Runtime.

Dynamic batching hands ``execute`` several requests at once; requests of the same sequence
length are stacked into one ONNX Runtime call (that is what batching buys on a CPU).
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

    def execute(self, requests: list[Any]) -> list[Any]:
        inputs = [pb_utils.get_input_tensor_by_name(r, "input_ids").as_numpy().astype(np.int64) for r in requests]
        responses: list[Any] = [None] * len(requests)
        by_length: dict[int, list[int]] = {}
        for index, ids in enumerate(inputs):
            by_length.setdefault(ids.shape[1], []).append(index)
        for indices in by_length.values():
            stacked = np.concatenate([inputs[i] for i in indices])
            logits, next_token = self.session.run(["logits", "next_token"], {"input_ids": stacked})
            row = 0
            for i in indices:
                rows = inputs[i].shape[0]
                responses[i] = pb_utils.InferenceResponse([
                    pb_utils.Tensor("logits", logits[row:row + rows].astype(np.float32)),
                    pb_utils.Tensor("next_token", next_token[row:row + rows].astype(np.int64)),
                ])
                row += rows
        return responses
