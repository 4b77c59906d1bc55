"""The canary's false-rollback rate: A/A rollouts of a version whose weights equal the champion's,
beside rollouts of a slow and a wrong version that must still be rolled back, in one run.

    .venvs/runtime/bin/python benchmarks/canary_aa.py [--rollouts 20] [--bad-rollouts 3] [--output FILE]

It starts the real stack (SeaweedFS, MLflow, Triton, the OpenAI front, nginx) on benchmarks/serve.py's
ports, registers a cpu-tiny GPT (random weights) and a copy of it (the same logged model registered
again: equal weights, another version), exports both with the export step and promotes the first.
Then ``--rollouts`` deploys with params.yaml's canary settings, each version in turn over the other
(A over B, B over A, ...: every rollout is a canary of the weights already serving). Then
``--bad-rollouts`` each of:

- slow: a bigger GPT (d_model 256, 8 layers; ~5x the compute per token): its latency must fail;
- wrong: a copy's export with another model's KV-cache decoder in place of its own (the logits
  model and the reference text are the champion's): its text must fail. (The other model's
  matrices are scaled 10x: random-weight GPTs of any seed otherwise all repeat the last token.)

Per rollout: the verdict, the shadow's and each step's, the check it failed at, and per stage how
many analyses it took (``canary.max_analyses``: an inconclusive stage is measured again on fresh
traffic). "would roll back with one analysis" counts the A/A rollouts whose first analysis of a
stage did not pass.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import shutil
import sys
import time
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))
sys.path.insert(0, str(REPO_ROOT / "benchmarks"))

from serve import benchmark_stack, make_tokenizer_and_eval_text, register, run_module, run_step  # noqa: E402

from tasks.lib.params import load_settings  # noqa: E402


def register_copy(name: str, version: str) -> str:
    """The same logged model registered again: another version, equal weights and tags."""
    import mlflow
    from mlflow import MlflowClient

    source = MlflowClient().get_model_version(name, version)
    return str(mlflow.register_model(source.source, name, tags=dict(source.tags)).version)


def swap_decoder(export: Path, version: str, donor: Path, donor_version: str, out: Path) -> Path:
    """A copy of ``export`` with ``donor``'s KV-cache decoder in place of its own, committed again
    as the export step would: the logits model and the reference stay, the engine's text does not."""
    from tasks.lib import storage

    with storage.staged_output(str(out)) as staging:
        shutil.copytree(export, staging, dirs_exist_ok=True, ignore=shutil.ignore_patterns(storage.SUCCESS_MARKER))
        decoder = Path("triton") / "llm_generate" / version / "decoder.onnx"
        shutil.copyfile(donor / "triton" / "llm_generate" / donor_version / "decoder.onnx", staging / decoder)
    return out


def rollout(kind: str, version: str, export: Path, output: Path, env: dict[str, str]) -> dict[str, Any]:
    started = time.monotonic()
    proc = run_module("tasks.deploy", "canary", "--model-version", version, "--export", str(export), "--output",
                      str(output), "--no-promote", env=env, ok=(0, 2))  # 2: rolled back
    if not (output / "report.json").exists():
        raise SystemExit(f"deploy of version {version} failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}")
    report = json.loads((output / "report.json").read_text())
    steps = [{"weight": "shadow", "analysis": s["analysis"], "passed": s["passed"],
              "failed": [c["check"] for c in s["checks"] if not c["passed"]], "latency_ratio": None,
              "ttft_ratio": s["paired_tests"].get("ttft_ms", {}).get("median_ratio"),
              "itl_ratio": s["paired_tests"].get("itl_ms", {}).get("median_ratio")} for s in report.get("shadow", [])]
    steps += [{"weight": s["weight"], "analysis": s.get("analysis", 1), "passed": s["passed"],
               "failed": [c["check"] for c in s["checks"] if not c["passed"]],
               "latency_ratio": s["latency_test"].get("median_ratio"),
               "ttft_ratio": s["text"].get("tests", {}).get("ttft_ms", {}).get("median_ratio"),
               "itl_ratio": s["text"].get("tests", {}).get("itl_ms", {}).get("median_ratio")} for s in report["steps"]]
    result = {"kind": kind, "version": version, "verdict": report["verdict"], "reason": report.get("reason", ""),
              "seconds": round(time.monotonic() - started, 1), "steps": steps}
    print(f"{kind:<5} v{version}: {result['verdict']:<11} {result['seconds']:>5.1f} s  "
          + ", ".join(f"{stage_name(s['weight'])}#{s['analysis']} " + ("pass" if s["passed"] else "/".join(s["failed"]))
                      for s in steps), flush=True)
    return result


def stage_name(weight: float | str) -> str:
    return weight if isinstance(weight, str) else f"{weight:g}%"


def remeasured(result: dict[str, Any]) -> bool:
    """A step whose first analysis failed: with one analysis the rollout would have rolled back."""
    return any(s["analysis"] == 1 and not s["passed"] for s in result["steps"])


def max_ratio(results: list[dict[str, Any]], key: str) -> str:
    values = [s[key] for r in results for s in r["steps"] if s[key] is not None]
    return f"{max(values):.2f}" if values else "-"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rollouts", type=int, default=20, help="A/A rollouts")
    parser.add_argument("--bad-rollouts", type=int, default=3, help="rollouts of each bad version")
    parser.add_argument("--output", type=Path, help="write every rollout's figures here (JSON)")
    args = parser.parse_args()
    settings = load_settings()
    preset, vocab = settings.train.presets["cpu-tiny"], settings.tokenize.vocab_size
    results: list[dict[str, Any]] = []
    with benchmark_stack(settings, "bench-canary-aa") as (folder, env, name):
        tokenizer_uri, eval_text = make_tokenizer_and_eval_text(folder, vocab)
        champion = register(name, tokenizer_uri, 1, preset, vocab)
        versions = {"a": champion, "b": register_copy(name, champion), "wrong": register_copy(name, champion),
                    "slow": register(name, tokenizer_uri, 4, dataclasses.replace(preset, d_model=256, n_layers=8),
                                     vocab),
                    "donor": register(name, tokenizer_uri, 2, preset, vocab, weight_scale=10)}
        exports = {k: folder / f"export-{k}" for k in versions}
        for kind, version in versions.items():
            run_step("tasks.export", "--model-version", version, "--output", str(exports[kind]), "--eval-set",
                     str(eval_text), "--no-mlflow", env=env)
        exports["wrong"] = swap_decoder(exports["wrong"], versions["wrong"], exports["donor"], versions["donor"],
                                        folder / "export-wrong-decoder")

        first = rollout("first", versions["a"], exports["a"], folder / "deploy-first", env)
        assert first["verdict"] == "promoted", first
        serving = "a"
        for i in range(args.rollouts):
            canary = "b" if serving == "a" else "a"
            results.append(rollout("A/A", versions[canary], exports[canary], folder / f"deploy-aa-{i}", env))
            serving = canary if results[-1]["verdict"] == "promoted" else serving
        for i in range(args.bad_rollouts):
            for kind in ("slow", "wrong"):
                results.append(rollout(kind, versions[kind], exports[kind], folder / f"deploy-{kind}-{i}", env))

    if args.output:
        args.output.write_text(json.dumps(results, indent=1))
    canary_settings = settings.canary
    print(f"\ncanary steps {list(canary_settings.steps)}, {canary_settings.step_duration_s:g} s windows, "
          f"shadow {canary_settings.shadow}, max_analyses {canary_settings.max_analyses}; cpu-tiny GPT, 2 versions of equal weights "
          "served in turn")
    header = ("canary", "rollouts", "promoted", "rolled back", "one analysis would roll back", "max latency ratio",
              "max TTFT ratio", "max ITL ratio", "failed on")
    print("| " + " | ".join(header) + " |\n|" + "---|" * len(header))
    for kind in ("A/A", "slow", "wrong"):
        mine = [r for r in results if r["kind"] == kind]
        if not mine:
            continue
        promoted = sum(r["verdict"] == "promoted" for r in mine)
        reasons = sorted({r["reason"].split(":")[0] for r in mine if r["reason"]})
        print(f"| {kind} | {len(mine)} | {promoted} | {len(mine) - promoted} | {sum(map(remeasured, mine))} | "
              f"{max_ratio(mine, 'latency_ratio')} | {max_ratio(mine, 'ttft_ratio')} | {max_ratio(mine, 'itl_ratio')} | "
              f"{', '.join(reasons) or '-'} |")


if __name__ == "__main__":
    main()
