"""What the shadow stage costs users: stable's own latency with and without a shadow version
receiving a copy of every ``/v1`` request, side by side in one run.

    .venvs/runtime/bin/python benchmarks/shadow.py [--rounds 3] [--seconds 10] [--rps 6]

It starts the real stack (SeaweedFS, MLflow, Triton, the OpenAI front, nginx) on benchmarks/serve.py's
ports, registers a cpu-tiny GPT (random weights) and a copy of it (equal weights, another
version), exports both with the export step and deploys the first (promoted alone). Then, with
both versions loaded, rounds of the same load (streamed greedy completions of the export's
reference prompts through the router at ``--rps`` for ``--seconds``, the canary's generator) go
alternately to a route without a shadow and to one mirroring every request to the copy. Per
mode: stable's time to first token, inter-token latency and whole-stream time as its clients
measure them (p50 and p90 over all rounds), and how many copies the shadow answered. A third
mode mirrors to a version that is not loaded: the mirror's own cost (nginx's subrequest, the
front's 202), without the copy's generation. On one machine the copy's generation competes with
stable's for the same cores; in a cluster it runs on the canary track's own pod.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))
sys.path.insert(0, str(REPO_ROOT / "benchmarks"))

from canary_aa import register_copy  # noqa: E402
from serve import benchmark_stack, make_tokenizer_and_eval_text, register, run_step  # noqa: E402

from tasks.lib.params import load_settings  # noqa: E402

# the copy's generation (on one machine, beside stable's), and the mirror alone (copies sent to a
# version that is not loaded: nginx's mirror and the front's answer to it, no generation)
MODES = ("no shadow", "mirror only", "shadow")
NOT_LOADED = 999_999


def percentiles(values: list[float]) -> tuple[float, float]:
    finite = np.asarray([v for v in values if math.isfinite(v)])
    if not len(finite):
        return math.nan, math.nan
    return float(np.percentile(finite, 50)), float(np.percentile(finite, 90))


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--rps", type=float, default=6.0, help="streams a second (params.yaml canary.text_rps: 6)")
    args = parser.parse_args()
    settings = load_settings()
    preset, vocab, params = settings.train.presets["cpu-tiny"], settings.tokenize.vocab_size, settings.canary
    samples: dict[str, list[Any]] = {mode: [] for mode in MODES}
    copies = {"sent": 0, "answered": 0}
    with benchmark_stack(settings, "bench-shadow") as (folder, env, name):
        tokenizer_uri, eval_text = make_tokenizer_and_eval_text(folder, vocab)
        stable = register(name, tokenizer_uri, 1, preset, vocab)
        shadow = register_copy(name, stable)
        exports = {v: folder / f"export-{v}" for v in (stable, shadow)}
        for version, export in exports.items():
            run_step("tasks.export", "--model-version", version, "--output", str(export), "--eval-set",
                     str(eval_text), "--no-mlflow", env=env)
        run_step("tasks.deploy", "canary", "--model-version", stable, "--export", str(exports[stable]), "--output",
                 str(folder / "deploy"), "--no-promote", env=env)
        os.environ.update(env)
        from tasks.serving import traffic
        from tasks.serving.platforms import serving_platform

        serving = serving_platform(settings)
        reference = serving.stage(str(exports[stable]), int(stable), folder)
        serving.stage(str(exports[shadow]), int(shadow), folder)
        serving.prepare(int(stable), int(shadow))
        requests = traffic.text_requests(reference)
        try:
            for _ in range(args.rounds):
                for mode in MODES:
                    copy_to = {"no shadow": None, "mirror only": NOT_LOADED, "shadow": int(shadow)}[mode]
                    serving.route(int(stable), shadow=copy_to)
                    load = traffic.Load(args.rps, args.seconds, params.concurrency, params.text_timeout_s)
                    sent = traffic.send_text_traffic(traffic.Target(serving.url + "/v1/completions"), requests, load,
                                                     with_ids=True)
                    samples[mode] += sent
                    if mode == "shadow":
                        ids = [s.request_id for s in sent if s.ok]
                        # the copies still generating finish first (their records are what judges a shadow)
                        time.sleep(params.text_timeout_s / 10)
                        records = serving.shadow_records(ids, int(stable), int(shadow))
                        copies["sent"] += len(ids)
                        copies["answered"] += sum(r["ok"] and r["version"] == int(shadow) for r in records)
        finally:
            serving.roll_back(int(stable))

    print(f"\n{args.rounds} rounds of {args.seconds:g} s at {args.rps:g} streams/s each mode, interleaved; "
          f"{os.cpu_count()} CPUs; cpu-tiny GPT; the shadow answered {copies['answered']} of {copies['sent']} copies")
    print(f"{'stable, as clients see it':<28}{'TTFT p50':>10}{'TTFT p90':>10}{'ITL p50':>9}{'stream p50':>12}"
          f"{'stream p90':>12}{'ok':>6}")
    rows = {}
    for mode in MODES:
        ok = [s for s in samples[mode] if s.ok]
        ttft, itl = percentiles([s.ttft_ms for s in ok]), percentiles([s.itl_ms for s in ok])
        whole = percentiles([s.ttft_ms + s.itl_ms * (s.chunks - 1) if s.chunks > 1 else s.ttft_ms for s in ok])
        rows[mode] = (ttft[0], whole[0])
        print(f"{mode:<28}{ttft[0]:>10.1f}{ttft[1]:>10.1f}{itl[0]:>9.2f}{whole[0]:>12.1f}{whole[1]:>12.1f}"
              f"{len(ok):>4}/{len(samples[mode])}")
    ttft_off, whole_off = rows["no shadow"]
    for mode in MODES[1:]:
        ttft_on, whole_on = rows[mode]
        print(f"{mode} / no shadow: TTFT p50 {ttft_on / ttft_off:.2f}, whole stream p50 {whole_on / whole_off:.2f}")


if __name__ == "__main__":
    main()
