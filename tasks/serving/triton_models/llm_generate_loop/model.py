"""Triton python backend: the generation loop the engine replaced, kept as the LLM serving
benchmark's baseline (``benchmarks/serve_llm.py``); nothing in the pipeline serves it.

Encodes the prompt with the tokenizer shipped in this version's folder, then asks the logits
model of the *same version* for one token at a time through BLS (Triton's in-process inference
API), greedy or top-k, until EOS or ``max_tokens``: no KV cache (each token recomputes the whole
window) and one request at a time per instance. It speaks the engine's generate-extension names
(``text_input``, ``max_tokens``, ``ignore_eos``; ``text_output``, ``finish_reason``,
``prompt_tokens``, ``completion_tokens``) so the same OpenAI front can sit in front of it, but it
is not decoupled: a streamed request gets one event, at the end, with the whole text.
The engine's other inputs (sampling values, ``stop``, ``stream``) are accepted and ignored.
"""

from __future__ import annotations

import json
import os
from typing import Any

import numpy as np
import triton_python_backend_utils as pb_utils
from tokenizers import Tokenizer

EOS = "<|endoftext|>"


def scalar(request: Any, name: str) -> Any:
    tensor = pb_utils.get_input_tensor_by_name(request, name)
    return None if tensor is None else tensor.as_numpy().reshape(-1)[0]


class TritonPythonModel:
    def initialize(self, args: dict[str, Any]) -> None:
        folder = os.path.join(args["model_repository"], args["model_version"])
        self.version = int(args["model_version"])
        self.tokenizer = Tokenizer.from_file(os.path.join(folder, "tokenizer.json"))
        with open(os.path.join(folder, "generation.json")) as fh:
            shape = json.load(fh)
        self.seq_len = int(shape["seq_len"])
        params = {k: v["string_value"] for k, v in json.loads(args["model_config"]).get("parameters", {}).items()}
        self.logits_model = params["logits_model"]
        self.max_tokens = int(params["max_tokens"])
        self.top_k = int(params["top_k"])
        # a base checkpoint's own end and start ids (the engine's: generation.json); exports
        # before them, and the demo's tokenizer: <|endoftext|>, no BOS
        stops = list(shape.get("eos_ids") or ()) or [self.tokenizer.token_to_id(EOS)]
        if stops[0] is None:
            raise pb_utils.TritonModelException(f"tokenizer.json has no {EOS} token, and generation.json no eos_ids")
        self.eos_ids = frozenset(int(i) for i in stops)
        bos = shape.get("bos_id")
        self.prefix: list[int] = [] if bos is None else [int(bos)]
        self.eos_id: int = int(stops[0])
        self.rng = np.random.default_rng(0)

    def next_token(self, ids: list[int]) -> int:
        window = np.asarray([ids[-self.seq_len:]], dtype=np.int64)
        request = pb_utils.InferenceRequest(
            model_name=self.logits_model, model_version=self.version,
            requested_output_names=["logits", "next_token"], inputs=[pb_utils.Tensor("input_ids", window)],
        )
        response = request.exec()
        if response.has_error():
            raise pb_utils.TritonModelException(response.error().message())
        if self.top_k <= 1:
            return int(pb_utils.get_output_tensor_by_name(response, "next_token").as_numpy().reshape(-1)[0])
        logits = pb_utils.get_output_tensor_by_name(response, "logits").as_numpy().reshape(-1)
        top = np.argpartition(logits, -self.top_k)[-self.top_k:]
        weights = np.exp(logits[top] - logits[top].max())
        return int(self.rng.choice(top, p=weights / weights.sum()))

    def execute(self, requests: list[Any]) -> list[Any]:
        responses = []
        for request in requests:
            prompt = scalar(request, "text_input")
            if prompt is None:
                error = pb_utils.TritonError("text_input is missing", pb_utils.TritonError.INVALID_ARG)
                responses.append(pb_utils.InferenceResponse(output_tensors=[], error=error))
                continue
            prompt = prompt.decode("utf-8", errors="replace") if isinstance(prompt, bytes) else str(prompt)
            limit = scalar(request, "max_tokens")
            limit = self.max_tokens if limit is None else int(limit)
            ignore_eos = bool(scalar(request, "ignore_eos") or False)
            ids = self.prefix + self.tokenizer.encode(prompt, add_special_tokens=False).ids or [self.eos_id]
            new: list[int] = []
            reason = "length"
            try:
                for _ in range(max(0, min(limit, self.seq_len))):  # the window slides: at most a context's worth
                    token = self.next_token(ids + new)
                    if token in self.eos_ids and not ignore_eos:
                        reason = "stop"
                        break
                    new.append(token)
            except pb_utils.TritonModelException as exc:
                responses.append(pb_utils.InferenceResponse(output_tensors=[], error=pb_utils.TritonError(str(exc))))
                continue
            responses.append(pb_utils.InferenceResponse([
                pb_utils.Tensor("text_output", np.asarray([self.tokenizer.decode(new).encode()], dtype=object)),
                pb_utils.Tensor("finish_reason", np.asarray([reason.encode()], dtype=object)),
                pb_utils.Tensor("prompt_tokens", np.asarray([len(ids)], dtype=np.int32)),
                pb_utils.Tensor("completion_tokens", np.asarray([len(new)], dtype=np.int32))]))
        return responses
