"""Export a registered model for Triton: ONNX (+ TensorRT on GPUs), parity-checked.

Input: ``models:/<model_name>/<version>`` (register's result). Output: a run-scoped folder
holding a Triton model-repository fragment for that version

    triton/llm/config.pbtxt                 the served backend (params.yaml serve.backend)
    triton/llm/<version>/model.onnx         next-token logits, dynamic batch and sequence axes
    triton/llm/<version>/model.py           python backend (ONNX Runtime), used by that backend
    triton/llm_generate/config.pbtxt        text in, text out (python backend, BLS)
    triton/llm_generate/<version>/          model.py, tokenizer.json, generation.json
    configs/                                every backend's config.pbtxt and load-API JSON
    parity.json                             the figures below + the reference the canary checks
    model.plan                              TensorRT FP16 engine (gpu kind only)

Parity: ONNX Runtime against PyTorch on real inputs (the fixed prompts and windows of the
held-out evaluation text, of several lengths and batch sizes): the largest absolute logit
difference must stay within ``export.parity_atol`` and every greedy next token must match,
else the step fails with one line naming the worst input. The figures go into the result,
the model version's tags and the DAG run's MLflow run, with the ONNX file and the configs.
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import torch

from tasks.lib import storage, tokens, triton
from tasks.lib.errors import StepError
from tasks.lib.model import GPT
from tasks.lib.model_store import load_version
from tasks.lib.params import REPO_ROOT, load_params, step_params
from tasks.lib.step import log, run_step, step_parser
from tasks.lib.tracking import find_dag_run

TRITON_MODELS = REPO_ROOT / "tasks" / "triton_models"
ONNX_INPUTS, ONNX_OUTPUTS = ["input_ids"], ["logits", "next_token"]


class NextToken(torch.nn.Module):
    """What is served: the logits of the token after the last one, and the greedy choice."""

    def __init__(self, model: GPT) -> None:
        super().__init__()
        self.model = model

    def forward(self, input_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        logits = self.model(input_ids)[:, -1, :].float()
        return logits, logits.argmax(dim=-1, keepdim=True)


def export_onnx(model: GPT, path: Path, opset: int, max_batch: int) -> None:
    """The dynamo exporter, batch and sequence axes dynamic (sequence up to the model's seq_len)."""
    seq_len = model.config.seq_len
    example = torch.zeros((2, min(16, seq_len)), dtype=torch.long)
    dynamic = {"input_ids": {0: torch.export.Dim("batch", min=1, max=max_batch),
                             1: torch.export.Dim("seq", min=1, max=seq_len)}}
    program = torch.onnx.export(NextToken(model).eval(), (example,), dynamo=True, opset_version=opset,
                                input_names=ONNX_INPUTS, output_names=ONNX_OUTPUTS, dynamic_shapes=dynamic)
    if program is None:
        raise RuntimeError("torch.onnx.export returned no program")
    program.save(str(path))


def parity_inputs(model: GPT, tokenizer: Any, eval_text: Path, prompts: list[str], windows: int,
                  seed: int = 0) -> list[np.ndarray[Any, Any]]:
    """Real inputs: each prompt alone, then batches of held-out windows of several lengths."""
    from tasks.evaluate import eval_set_stream

    batches = [np.asarray([tokenizer.encode(p, add_special_tokens=False).ids], dtype=np.int64) for p in prompts]
    stream, _ = eval_set_stream(eval_text, tokenizer)
    seq_len = model.config.seq_len
    rng = np.random.default_rng(seed)
    lengths = sorted({max(1, seq_len // 8), seq_len // 2, seq_len})
    for index in range(windows):
        length = lengths[index % len(lengths)]
        batch = 1 + index % 4
        starts = rng.integers(0, max(1, len(stream) - length), size=batch)
        batches.append(np.stack([stream[s:s + length] for s in starts]).astype(np.int64))
    return batches


@torch.no_grad()
def check_parity(model: GPT, onnx_path: Path, inputs: list[np.ndarray[Any, Any]], atol: float) -> dict[str, Any]:
    """ONNX Runtime vs PyTorch on every input; raises StepError past the tolerance."""
    import onnxruntime as ort

    session = ort.InferenceSession(str(onnx_path), providers=["CPUExecutionProvider"])
    reference = NextToken(model).eval()
    worst = (0.0, -1)
    mismatches = []
    expected_tokens = []
    for index, ids in enumerate(inputs):
        torch_logits, torch_next = (t.numpy() for t in reference(torch.from_numpy(ids)))
        ort_logits, ort_next = session.run(ONNX_OUTPUTS, {"input_ids": ids})
        diff = float(np.abs(ort_logits - torch_logits).max())
        if not np.isfinite(ort_logits).all() or not np.isfinite(diff):
            raise StepError(f"ONNX model: non-finite logits on parity input {index} (shape {list(ids.shape)})")
        worst = max(worst, (diff, index))
        if not np.array_equal(ort_next, torch_next):
            mismatches.append(index)
        expected_tokens.append(torch_next.reshape(-1).tolist())
    max_diff, at = worst
    if max_diff > atol:
        raise StepError(f"ONNX parity: max |logit difference| {max_diff:.3g} > tolerance {atol:g} "
                        f"on input {at} (shape {list(inputs[at].shape)})")
    if mismatches:
        raise StepError(f"ONNX parity: greedy next tokens differ from PyTorch on {len(mismatches)} of "
                        f"{len(inputs)} inputs (first: input {mismatches[0]}, shape {list(inputs[mismatches[0]].shape)})")
    return {"max_abs_logit_diff": max_diff, "tolerance": atol, "inputs": len(inputs),
            "sequences": int(sum(len(i) for i in inputs)),
            "expected_next_tokens": expected_tokens}


def tensorrt_profile(seq_len: int, trt: dict[str, Any]) -> dict[str, tuple[int, int]]:
    """(min, opt, max) batch and sequence sizes of the engine's optimization profile."""
    batch, seq = trt["batch"], trt["seq"]
    return {"input_ids_min": (int(batch["min"]), int(seq["min"])),
            "input_ids_opt": (int(batch["opt"]), min(int(seq["opt"]), seq_len)),
            "input_ids_max": (int(batch["max"]), seq_len)}


def build_tensorrt(onnx_path: Path, plan_path: Path, seq_len: int, trt_params: dict[str, Any]) -> str:
    """An FP16 TensorRT engine from the ONNX file, or why none was built (never faked)."""
    if not torch.cuda.is_available():
        log.info("TensorRT: skipped, no GPU on this machine (the gpu image builds model.plan)")
        return "skipped: no GPU"
    try:
        import tensorrt as trt
    except ImportError:
        log.info("TensorRT: skipped, the tensorrt package is not installed in this image")
        return "skipped: tensorrt not installed"
    logger = trt.Logger(trt.Logger.WARNING)
    builder = trt.Builder(logger)
    network = builder.create_network(0)
    parser = trt.OnnxParser(network, logger)
    if not parser.parse_from_file(str(onnx_path)):
        errors = "; ".join(str(parser.get_error(i)) for i in range(parser.num_errors))
        raise StepError(f"{onnx_path.name}: TensorRT cannot parse it: {errors}")
    config = builder.create_builder_config()
    config.set_memory_pool_limit(trt.MemoryPoolType.WORKSPACE, int(trt_params["workspace_gb"]) << 30)
    if trt_params.get("fp16", True):
        config.set_flag(trt.BuilderFlag.FP16)
    profile = builder.create_optimization_profile()
    shapes = tensorrt_profile(seq_len, trt_params)
    profile.set_shape("input_ids", shapes["input_ids_min"], shapes["input_ids_opt"], shapes["input_ids_max"])
    config.add_optimization_profile(profile)
    engine = builder.build_serialized_network(network, config)
    if engine is None:
        raise StepError(f"{onnx_path.name}: TensorRT engine build failed")
    plan_path.write_bytes(bytes(engine))
    return "built: fp16" if trt_params.get("fp16", True) else "built: fp32"


def write_repository(out: Path, version: str, onnx_path: Path, tokenizer_path: Path, seq_len: int,
                     serve: dict[str, Any]) -> dict[str, Any]:
    """The Triton repository fragment of this version and every backend's configuration."""
    logits_name, generate_name = serve["triton_model"], serve["generate_model"]
    served = triton.logits_model_config(logits_name, serve["backend"], serve)
    generate = triton.generate_model_config(generate_name, logits_name, serve)
    logits_dir = out / "triton" / logits_name / version
    generate_dir = out / "triton" / generate_name / version
    logits_dir.mkdir(parents=True)
    generate_dir.mkdir(parents=True)
    shutil.copy(onnx_path, logits_dir / "model.onnx")
    shutil.copy(TRITON_MODELS / "llm" / "model.py", logits_dir / "model.py")
    shutil.copy(TRITON_MODELS / "llm_generate" / "model.py", generate_dir / "model.py")
    shutil.copy(tokenizer_path, generate_dir / "tokenizer.json")
    (generate_dir / "generation.json").write_text(json.dumps({"seq_len": seq_len}))
    (out / "triton" / logits_name / "config.pbtxt").write_text(triton.to_pbtxt(served))
    (out / "triton" / generate_name / "config.pbtxt").write_text(triton.to_pbtxt(generate))
    configs = out / "configs"
    configs.mkdir()
    variants = {"python": triton.logits_model_config(logits_name, "python", serve),
                "onnxruntime_onnx.cpu": triton.logits_model_config(logits_name, "onnxruntime_onnx", serve),
                "onnxruntime_onnx.gpu": triton.logits_model_config(logits_name, "onnxruntime_onnx", serve, gpu=True),
                "tensorrt_plan.gpu": triton.logits_model_config(logits_name, "tensorrt_plan", serve, gpu=True)}
    for variant, config in variants.items():
        (configs / f"{logits_name}.{variant}.pbtxt").write_text(triton.to_pbtxt(config))
    (configs / f"{logits_name}.json").write_text(json.dumps(served, indent=1))
    (configs / f"{generate_name}.json").write_text(json.dumps(generate, indent=1))
    return served


def log_to_registry(name: str, version: str, dag_run_tag: str, output: str, out: Path,
                    result: dict[str, Any]) -> None:
    """The ONNX file and configs into the DAG run's MLflow run, the export's figures as tags of
    the model version: the registry says what was deployed and from where."""
    import mlflow
    from mlflow import MlflowClient

    client = MlflowClient()
    tags = {"export.uri": output, "export.onnx_sha256": result["onnx_sha256"], "export.opset": str(result["opset"]),
            "export.backend": result["backend"], "export.tensorrt": result["tensorrt"],
            "export.parity_max_abs_logit_diff": f"{result['parity']['max_abs_logit_diff']:.3g}"}
    for key, value in tags.items():
        client.set_model_version_tag(name, version, key, value)
    run_id = find_dag_run(load_params()["train"]["experiment"], dag_run_tag) if dag_run_tag else None
    if run_id is None:
        log.warning("no MLflow run tagged dag_run=%s: export artifacts stay in %s", dag_run_tag, output)
        return
    with mlflow.start_run(run_id=run_id):
        mlflow.log_artifacts(str(out / "configs"), "export/configs")
        mlflow.log_artifact(str(out / "parity.json"), "export")
        logits_model = load_params()["serve"]["triton_model"]
        mlflow.log_artifact(str(out / "triton" / logits_model / version / "model.onnx"), "export")
        mlflow.log_metric("export.parity_max_abs_logit_diff", result["parity"]["max_abs_logit_diff"])


def main(args: argparse.Namespace) -> dict[str, Any]:
    params = step_params("export", args.overrides)
    settings = load_params()
    serve, name = settings["serve"], settings["pipeline"]["model_name"]
    version = str(args.model_version)
    if not version.isdigit():
        raise StepError(f"--model-version {version!r}: expected a registry version number")
    with storage.scratch() as scratch, storage.staged_output(args.output) as out:
        loaded = load_version(name, version)
        tokenizer_path = storage.download(loaded.tokenizer_uri, scratch / "tokenizer.json")
        tokenizer = tokens.load_tokenizer(str(tokenizer_path), scratch)  # a local path: not copied again
        eval_text = storage.download(args.eval_set or settings["evaluate"]["eval_set_uri"], scratch / "eval.jsonl")
        onnx_path = scratch / "model.onnx"
        export_onnx(loaded.model, onnx_path, int(params["opset"]), int(serve["max_batch_size"]))
        inputs = parity_inputs(loaded.model, tokenizer, eval_text, list(settings["evaluate"]["prompts"]),
                               int(params["parity_windows"]))
        parity = check_parity(loaded.model, onnx_path, inputs, float(params["parity_atol"]))
        log.info("ONNX parity: max |logit diff| %.3g over %d inputs, all greedy next tokens equal",
                 parity["max_abs_logit_diff"], parity["inputs"])
        tensorrt = build_tensorrt(onnx_path, out / "model.plan", loaded.model.config.seq_len, params["tensorrt"])
        write_repository(out, version, onnx_path, Path(tokenizer_path), loaded.model.config.seq_len, serve)
        reference = {"inputs": [ids.tolist() for ids in inputs], "next_tokens": parity.pop("expected_next_tokens"),
                     "tokenizer_hash": loaded.description["tokenizer_hash"]}
        (out / "parity.json").write_text(json.dumps({**parity, "reference": reference}))
        result = {"model_name": name, "version": version, "export_uri": args.output, "opset": int(params["opset"]),
                  "onnx_sha256": storage.sha256_file(onnx_path), "onnx_bytes": onnx_path.stat().st_size,
                  "backend": serve["backend"], "tensorrt": tensorrt, "parity": parity}
        if args.mlflow:
            log_to_registry(name, version, args.mlflow_run_tag, args.output, out, result)
    return result


def parser() -> argparse.ArgumentParser:
    p = step_parser("export", __doc__.splitlines()[0])
    p.add_argument("--model-version", required=True, help="registry version of pipeline.model_name to export")
    p.add_argument("--output", required=True, help="run-scoped output folder URI")
    p.add_argument("--mlflow-run-tag", default="", help="dag_run tag of this DAG run (its MLflow run gets the artifacts)")
    p.add_argument("--eval-set", default="", help="held-out JSON Lines for parity inputs (default: evaluate.eval_set_uri)")
    p.add_argument("--no-mlflow", dest="mlflow", action="store_false", help="do not tag the version / log artifacts")
    return p


if __name__ == "__main__":
    run_step(parser(), main)
