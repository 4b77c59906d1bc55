"""The canary's false-rollback rate: A/A rollouts of a version whose weights equal the champion's,
beside rollouts of a slow and a wrong version that must still be rolled back, in one run, with
users streaming completions through the router the whole time.

    .venvs/runtime/bin/python benchmarks/canary_aa.py [--rollouts 20] [--bad-rollouts 3] [--output FILE]
        [--outside-streams 3] [--outside-pause-s 0.3]

It starts the real stack (SeaweedFS, MLflow, Triton, the OpenAI front, nginx) on benchmarks/serve.py's
ports, registers a cpu-tiny GPT (random weights) and a copy of it (the same logged model registered
again: equal weights, another version), exports both with the export step and promotes the first.
Then ``--rollouts`` deploys with params.yaml's canary settings, back to back (each starts as soon
as the last one ended: right after a promotion), each version in turn over the other (A over B,
B over A, ...: every rollout is a canary of the weights already serving). Then ``--bad-rollouts``
each of:

- slow: a bigger GPT (d_model 256, 8 layers; ~5x the compute per token): its latency must fail;
- wrong: a copy's export with another model's KV-cache decoders in place of its own (both
  ``decoder.onnx`` and the CPU's ``decoder_fused.onnx``; the logits model and the reference text
  are the champion's): its text must fail. (The other model's
  matrices are scaled 10x: random-weight GPTs of any seed otherwise all repeat the last token.)

An outside client (users, as issue 42 item 11 met them) streams completions through the router's
public URL (``ROUTER_URL``, ``/v1/completions``) from the first promotion to the end:
``--outside-streams`` streams at once, each user sending its next request after a pause
(exponential, mean ``--outside-pause-s``), its prompts the opening words of held-out documents,
``max_tokens`` 8 to 64, greedy or sampled. It is not told about rollouts; during the shadow stage
the router mirrors its requests to the new version too (that load is part of what is judged).
Per rollout it reports its requests, their errors by the version that answered
(``X-Model-Version``: stable's must be 0), and its time to first token and inter-token latency
(p50, as it measured them); ``--outside-streams 0`` runs without it (the 2026-11-25 method).

Per rollout: the verdict, the shadow's and each step's, the check it failed at, per stage how
many analyses it took (``canary.max_analyses``: an inconclusive stage is measured again on fresh
traffic), and how each stage's latencies were measured (``measured``: the shadow's and the steps'
text as the engines timed them, or as the chunks reached the front or deploy; the steps' logits as
Triton timed each version's compute, or as deploy's client received them); per step, Triton's own
mean time per logits request by version (in all, queued, computing). "would roll back with one analysis" counts the A/A
rollouts whose first analysis of a stage did not pass.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import random
import shutil
import sys
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))
sys.path.insert(0, str(REPO_ROOT / "benchmarks"))

from serve import benchmark_stack, make_tokenizer_and_eval_text, register, run_module, run_step  # noqa: E402

from stack.traffic import prompts  # noqa: E402
from tasks.lib.params import load_settings  # noqa: E402
from tasks.serving.analysis import ENGINE_TIMED, FRONT_TIMED, TRITON_TIMED  # noqa: E402
from tasks.serving.traffic import Target, TextSample, one_stream  # noqa: E402

OUTSIDE_MAX_TOKENS = (8, 16, 32, 64)  # with prompts of at most context - 64 tokens: none refused as too long
OUTSIDE_TEMPERATURES = (0.0, 0.8)


def register_copy(name: str, version: str) -> str:
    """The same logged model registered again: another version, equal weights and tags."""
    import mlflow
    from mlflow import MlflowClient

    source = MlflowClient().get_model_version(name, version)
    return str(mlflow.register_model(source.source, name, tags=dict(source.tags)).version)


DECODER_FILES = ("decoder.onnx", "decoder.onnx.data", "decoder_fused.onnx", "decoder_fused.onnx.data")


def swap_decoder(export: Path, version: str, donor: Path, donor_version: str, out: Path) -> Path:
    """A copy of ``export`` with ``donor``'s KV-cache decoders in place of its own (``decoder.onnx``,
    which GPUs serve, and ``decoder_fused.onnx``, which CPUs serve wherever the export wrote one),
    committed again as the export step would: the logits model and the reference stay, the
    engine's text does not. A decoder file of ``export`` that the donor lacks is an error: the
    engine would serve the champion's weights from it, and the "wrong" build would be an A/A one."""
    from tasks.lib import storage

    mine = Path("triton") / "llm_generate" / version
    theirs = donor / "triton" / "llm_generate" / donor_version
    swapped = [name for name in DECODER_FILES if (export / mine / name).exists()]
    if missing := [name for name in swapped if not (theirs / name).exists()]:
        raise SystemExit(f"donor export {donor} lacks {', '.join(missing)}: the wrong build would keep its own")
    with storage.staged_output(str(out)) as staging:
        shutil.copytree(export, staging, dirs_exist_ok=True, ignore=shutil.ignore_patterns(storage.SUCCESS_MARKER))
        for name in swapped:
            shutil.copyfile(theirs / name, staging / mine / name)
    print(f"wrong build: {', '.join(swapped)} of v{donor_version} in v{version}'s export", flush=True)
    return out


class OutsideClient:
    """``streams`` users streaming completions through ``url`` (the router's public
    ``/v1/completions``) until :meth:`close`: each sends a request, reads its stream to the end
    (:func:`tasks.serving.traffic.one_stream`: the answering version, status, time to first
    chunk, mean gap between chunks), pauses, and sends the next. :meth:`take` hands over what
    was answered since the last call."""

    def __init__(self, url: str, texts: list[str], streams: int, pause_s: float, timeout_s: float,
                 seed: int = 11) -> None:
        self.url, self.texts, self.pause_s, self.timeout_s = url, texts, pause_s, timeout_s
        self.samples: list[TextSample] = []
        self.lock = threading.Lock()
        self.stopping = threading.Event()
        self.since = time.monotonic()
        self.threads = [threading.Thread(target=self.user, args=(seed + i,), name=f"outside-{i}", daemon=True)
                        for i in range(streams)]
        for thread in self.threads:
            thread.start()

    def user(self, seed: int) -> None:
        rng = random.Random(seed)
        while not self.stopping.is_set():
            body = {"prompt": rng.choice(self.texts), "max_tokens": rng.choice(OUTSIDE_MAX_TOKENS),
                    "temperature": rng.choice(OUTSIDE_TEMPERATURES), "stream": True}
            sample = one_stream(Target(self.url), json.dumps(body).encode(), "", self.timeout_s)
            with self.lock:
                self.samples.append(sample)
            self.stopping.wait(rng.expovariate(1 / self.pause_s) if self.pause_s > 0 else 0)

    def take(self) -> tuple[list[TextSample], float]:
        """The requests answered since the last call, and the seconds since."""
        with self.lock:
            taken, self.samples = self.samples, []
        now = time.monotonic()
        seconds, self.since = now - self.since, now
        return taken, seconds

    def close(self) -> None:
        self.stopping.set()
        for thread in self.threads:
            thread.join(self.timeout_s + 5)


def fitting(texts: list[str], tokenizer_path: str, context: int) -> list[str]:
    """The prompts that leave room for the outside client's longest answer in ``context`` tokens."""
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(tokenizer_path)
    room = context - max(OUTSIDE_MAX_TOKENS)
    return [t for t in texts if len(tokenizer.encode(t, add_special_tokens=False).ids) <= room]


def p50(values: list[float]) -> float:
    finite = [v for v in values if math.isfinite(v)]
    return float(np.median(finite)) if finite else math.nan


def outside_summary(samples: list[TextSample], seconds: float, stable: str | None, canary: str) -> dict[str, Any]:
    """What the outside client met during one rollout: its requests, their errors by the version
    that answered (``stable``: the one serving when the rollout began; ``None``: no version
    header, the router or the connection failed), its TTFT and ITL p50 (all answers, and stable's)."""
    def version(s: TextSample) -> str:
        return "none" if s.version is None else str(s.version)

    failed = [s for s in samples if not s.ok]
    ok = [s for s in samples if s.ok]
    mine = [s for s in ok if version(s) == stable]
    return {"requests": len(samples), "per_s": round(len(samples) / seconds, 2) if seconds > 0 else math.nan,
            "answered": dict(sorted(Counter(version(s) for s in samples).items())),
            "errors": len(failed), "stable_errors": sum(version(s) == stable for s in failed),
            "canary_errors": sum(version(s) == canary for s in failed),
            "unversioned_errors": sum(s.version is None for s in failed),
            "errors_by_status": dict(sorted(Counter(str(s.status) for s in failed).items())),
            "first_error": next((f"{s.status} {s.error}".strip() for s in failed), ""),
            "ttft_p50_ms": p50([s.ttft_ms for s in ok]), "itl_p50_ms": p50([s.itl_ms for s in ok]),
            "stable_ttft_p50_ms": p50([s.ttft_ms for s in mine]), "stable_itl_p50_ms": p50([s.itl_ms for s in mine])}


def shadow_step(s: dict[str, Any]) -> dict[str, Any]:
    tests = s["paired_tests"]
    return {"weight": "shadow", "analysis": s["analysis"], "passed": s["passed"],
            "failed": [c["check"] for c in s["checks"] if not c["passed"]], "latency_ratio": None,
            "ttft_ratio": tests.get("ttft_ms", {}).get("median_ratio"),
            "itl_ratio": tests.get("itl_ms", {}).get("median_ratio"),
            # how the paired figures were measured: "as the engines timed them" or "as the chunks reached the front"
            "measured": {key.removesuffix("_ms"): test.get("measured", "") for key, test in tests.items()},
            "pairs": s.get("served"),
            "figures": {who: {k: round(v, 3) if isinstance(v, float) and math.isfinite(v) else None
                              for k, v in s.get(who, {}).items()} for who in ("stable", "shadow")}}


def rollout(kind: str, version: str, export: Path, output: Path, env: dict[str, str], stable: str | None = None,
            outside: OutsideClient | None = None) -> dict[str, Any]:
    started = time.monotonic()
    proc = run_module("tasks.deploy", "canary", "--model-version", version, "--export", str(export), "--output",
                      str(output), "--no-promote", env=env, ok=(0, 2))  # 2: rolled back
    if not (output / "report.json").exists():
        raise SystemExit(f"deploy of version {version} failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}")
    report = json.loads((output / "report.json").read_text())
    steps = [shadow_step(s) for s in report.get("shadow", [])]
    steps += [{"weight": s["weight"], "analysis": s.get("analysis", 1), "passed": s["passed"],
               "failed": [c["check"] for c in s["checks"] if not c["passed"]],
               "latency_ratio": s["latency_test"].get("median_ratio"),
               "ttft_ratio": s["text"].get("tests", {}).get("ttft_ms", {}).get("median_ratio"),
               "itl_ratio": s["text"].get("tests", {}).get("itl_ms", {}).get("median_ratio"),
               "measured": {"latency": s["latency_test"].get("measured", ""),
                            **{key.removesuffix("_ms"): test.get("measured", "")
                               for key, test in s["text"].get("tests", {}).items()}},
               "figures": {who: engine_p50s(s["text"].get(who, {})) for who in ("canary", "stable")},
               "triton": triton_ms(s.get("triton", {}))} for s in report["steps"]]
    result = {"kind": kind, "version": version, "stable": stable, "verdict": report["verdict"],
              "reason": report.get("reason", ""), "seconds": round(time.monotonic() - started, 1), "steps": steps,
              "outside": outside_summary(*outside.take(), stable, version) if outside else None}
    line = f"{kind:<5} v{version}: {result['verdict']:<11} {result['seconds']:>5.1f} s  " + ", ".join(
        f"{stage_name(s['weight'])}#{s['analysis']} " + ("pass" if s["passed"] else "/".join(s["failed"]))
        + (f" ({timed_by(s)})" if s["measured"] else "") for s in steps)
    if result["outside"]:
        o = result["outside"]
        line += (f"\n      outside: {o['requests']} requests ({o['per_s']:g}/s), {o['errors']} errors "
                 f"(stable's {o['stable_errors']}), answered by {o['answered']}, TTFT p50 {o['ttft_p50_ms']:.1f} ms, "
                 f"ITL p50 {o['itl_p50_ms']:.2f} ms" + (f"; first error: {o['first_error'][:160]}" if o["errors"] else ""))
    print(line, flush=True)
    return result


def engine_p50s(stats: dict[str, Any]) -> dict[str, float | None]:
    """A version's time to first token and inter-token latency at a step (p50 ms, as its engine
    timed them): the milliseconds behind a step's ratios."""
    return {key: round(v, 3) if isinstance(v := stats.get(f"engine_{key}_p50_ms"), float) and math.isfinite(v) else None
            for key in ("ttft", "itl")}


def triton_ms(delta: dict[str, dict[str, float]]) -> dict[str, dict[str, float]]:
    """Per version, Triton's own mean time per logits request in one step (ms): in all, queued, computing."""
    def mean_ms(counters: dict[str, float], key: str) -> float:
        done = counters.get("success", 0.0)
        return round(counters.get(key, 0.0) / done / 1000, 3) if done else math.nan

    return {version: {"requests": c.get("success", 0.0), "request_ms": mean_ms(c, "duration_us"),
                      "queue_ms": mean_ms(c, "queue_us"), "compute_ms": mean_ms(c, "compute_us")}
            for version, c in delta.items()}


TIMERS = {ENGINE_TIMED: "the engines", TRITON_TIMED: "Triton", FRONT_TIMED: "the front"}


def timed_by(step: dict[str, Any]) -> str:
    """Who timed a stage's latencies: the engines, Triton, the front or deploy's client (per
    figure when they differ)."""
    measured = step["measured"] or {}
    names = {key: TIMERS.get(how, "deploy's client") for key, how in measured.items() if how}
    if len(set(names.values())) == 1:
        return f"timed by {next(iter(names.values()))}"
    return ", ".join(f"{key} by {who}" for key, who in names.items()) or "nothing compared"


def failed_on(result: dict[str, Any]) -> str:
    """The stage a rollout stopped at and the checks that failed there (its reason's head where
    no stage did: a smoke test)."""
    last = result["steps"][-1] if result["steps"] else None
    if last is None or last["passed"]:
        return result["reason"].split(":")[0]
    return f"{stage_name(last['weight'])} {'/'.join(last['failed'])}"


def stage_name(weight: float | str) -> str:
    return weight if isinstance(weight, str) else f"{weight:g}%"


def remeasured(result: dict[str, Any]) -> bool:
    """A step whose first analysis failed: with one analysis the rollout would have rolled back."""
    return any(s["analysis"] == 1 and not s["passed"] for s in result["steps"])


def max_ratio(results: list[dict[str, Any]], key: str) -> str:
    values = [s[key] for r in results for s in r["steps"] if s[key] is not None]
    return f"{max(values):.2f}" if values else "-"


def versions_timed(results: list[dict[str, Any]], shadow: bool) -> str:
    """Analyses (the shadow's, or the steps') whose latencies the versions' own servers timed
    (the engines for text, Triton's compute time for logits), of all."""
    measured = [s["measured"] for r in results for s in r["steps"] if s["measured"] and (s["weight"] == "shadow") == shadow]
    by_versions = sum(all(how in (ENGINE_TIMED, TRITON_TIMED) for how in m.values() if how) for m in measured)
    return f"{by_versions} of {len(measured)}" if measured else "-"


def figure_range(values: list[float], digits: int) -> str:
    finite = [v for v in values if math.isfinite(v)]
    return f"{min(finite):.{digits}f}-{max(finite):.{digits}f}" if finite else "-"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rollouts", type=int, default=20, help="A/A rollouts")
    parser.add_argument("--bad-rollouts", type=int, default=3, help="rollouts of each bad version")
    parser.add_argument("--outside-streams", type=int, default=3,
                        help="the outside client's streams at once through the router's public URL (0: none)")
    parser.add_argument("--outside-pause-s", type=float, default=0.3,
                        help="mean pause of each outside stream between its requests (exponential)")
    parser.add_argument("--output", type=Path, help="write every rollout's figures here (JSON)")
    args = parser.parse_args()
    settings = load_settings()
    preset, vocab = settings.train.presets["cpu-tiny"], settings.tokenize.vocab_size
    results: list[dict[str, Any]] = []
    outside: OutsideClient | None = None
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
        documents = [json.loads(line)["text"] for line in eval_text.read_text().splitlines() if line]
        try:
            if args.outside_streams > 0:
                outside = OutsideClient(env["ROUTER_URL"].rstrip("/") + "/v1/completions",
                                        fitting(prompts(documents, "normal", 500, seed=3), tokenizer_uri,
                                                preset.seq_len), args.outside_streams,
                                        args.outside_pause_s, settings.canary.text_timeout_s)
            serving = "a"
            for i in range(args.rollouts):  # back to back: each right after the last one's promotion
                canary = "b" if serving == "a" else "a"
                results.append(rollout("A/A", versions[canary], exports[canary], folder / f"deploy-aa-{i}", env,
                                       versions[serving], outside))
                serving = canary if results[-1]["verdict"] == "promoted" else serving
            for i in range(args.bad_rollouts):
                for kind in ("slow", "wrong"):
                    results.append(rollout(kind, versions[kind], exports[kind], folder / f"deploy-{kind}-{i}", env,
                                           versions[serving], outside))
        finally:
            if outside is not None:
                outside.close()

    if args.output:
        args.output.write_text(json.dumps(results, indent=1))
    canary_settings = settings.canary
    print(f"\ncanary steps {list(canary_settings.steps)}, {canary_settings.step_duration_s:g} s windows, "
          f"shadow {canary_settings.shadow}, max_analyses {canary_settings.max_analyses}; cpu-tiny GPT, 2 versions of "
          f"equal weights served in turn, rollouts back to back; outside client: "
          + (f"{args.outside_streams} streams at once through the router, {args.outside_pause_s:g} s mean pause"
             if args.outside_streams > 0 else "none"))
    header = ("canary", "rollouts", "promoted", "rolled back", "one analysis would roll back", "max latency ratio",
              "max TTFT ratio", "max ITL ratio", "shadow analyses timed by the engines",
              "step analyses timed by the versions", "failed on")
    print("| " + " | ".join(header) + " |\n|" + "---|" * len(header))
    kinds = [k for k in ("A/A", "slow", "wrong") if any(r["kind"] == k for r in results)]
    for kind in kinds:
        mine = [r for r in results if r["kind"] == kind]
        promoted = sum(r["verdict"] == "promoted" for r in mine)
        reasons = sorted({failed_on(r) for r in mine if r["verdict"] != "promoted"})
        print(f"| {kind} | {len(mine)} | {promoted} | {len(mine) - promoted} | {sum(map(remeasured, mine))} | "
              f"{max_ratio(mine, 'latency_ratio')} | {max_ratio(mine, 'ttft_ratio')} | {max_ratio(mine, 'itl_ratio')} | "
              f"{versions_timed(mine, shadow=True)} | {versions_timed(mine, shadow=False)} | "
              f"{', '.join(reasons) or '-'} |")
    if outside is None:
        return
    print("\noutside client (through the router's public URL, during the rollouts; per rollout p50s: lowest-highest)")
    columns = ("during", "requests", "per s", "errors", "on stable's answers", "on the canary's", "no version",
              "TTFT p50 ms", "ITL p50 ms")
    print("| " + " | ".join(columns) + " |\n|" + "---|" * len(columns))
    for kind in kinds:
        seen = [r["outside"] for r in results if r["kind"] == kind and r["outside"]]
        print(f"| {kind} | {sum(o['requests'] for o in seen)} | {figure_range([o['per_s'] for o in seen], 1)} | "
              f"{sum(o['errors'] for o in seen)} | {sum(o['stable_errors'] for o in seen)} | "
              f"{sum(o['canary_errors'] for o in seen)} | {sum(o['unversioned_errors'] for o in seen)} | "
              f"{figure_range([o['ttft_p50_ms'] for o in seen], 1)} | {figure_range([o['itl_p50_ms'] for o in seen], 2)} |")


if __name__ == "__main__":
    main()
