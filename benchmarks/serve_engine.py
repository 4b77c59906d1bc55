"""The generation engine alone, in-process: continuous batching over the KV-cache decoder, no
Triton, front or HTTP around it, at several concurrencies, with the cache in the host's memory
(:class:`KVDecoder`; updated in place by the fused decoder, ``decoder_fused.onnx``:
:class:`FusedKVDecoder`, the CPU default) and in the device's (:class:`DeviceKVDecoder`; its
decode step replayed as one CUDA graph: :class:`GraphKVDecoder`, the GPU default; the fused
decoder in half precision, its step a CUDA graph: :class:`DeviceFusedKVDecoder`, ``fused-half``),
and with each number of slots asked for, side by side, rounds interleaved.

    .venvs/runtime/bin/python benchmarks/serve_engine.py [--preset cpu-tiny] [--prompt 32] [--new 64]
        [--concurrency 1 8 32] [--slots 8 32] [--prefill-tokens 256] [--rounds 3]
        [--decoders host fused device graph fused-half] [--one-prompt-a-run] [--vary-prompts] [--output FILE]

A GPT of the preset (random weights: speed does not depend on them; ``params.yaml``'s
``train.presets`` and ``tokenize.vocab_size``), exported to ``decoder.onnx`` by the export step's
own function, run by ONNX Runtime on the best provider this onnxruntime has (CUDA on a GPU
machine with onnxruntime-gpu, else the CPU on every core). Each measurement submits
``max(16, concurrency)`` requests of random prompts, ``concurrency`` at a time, each for exactly
``--new`` tokens (``ignore_eos``), greedy; figures: output tokens/s over the measurement, per
request time to first token and inter-token latency (p50). Before the timings, every decoder's
greedy continuations of four prompts are checked against PyTorch's reference (the canary's rule);
a mismatch is printed and ends the run with exit 1 (half precision: the share of tokens before
each continuation's first difference is printed, a difference allowed).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))

import numpy as np  # noqa: E402
import torch  # noqa: E402
import yaml  # noqa: E402

from tasks.export import export_decoder  # noqa: E402
from tasks.lib import decoder_graph, tokens  # noqa: E402
from tasks.lib.model import GPT, GPTConfig, generate_greedy  # noqa: E402
from tasks.serving.triton_models.llm_generate.engine import (  # noqa: E402
    CacheShape,
    DeviceFusedKVDecoder,
    DeviceKVDecoder,
    Engine,
    EngineLimits,
    FusedKVDecoder,
    GraphKVDecoder,
    KVDecoder,
    SamplingParams,
    SamplingRequest,
    Sequence,
    check_sampling,
    generate,
)

DECODERS = {"host": KVDecoder, "device": DeviceKVDecoder, "graph": GraphKVDecoder, "fused": FusedKVDecoder,
            "fused-half": DeviceFusedKVDecoder}
FILES = {"fused": FusedKVDecoder.FILE, "fused-half": "decoder_fused_half.onnx"}
HALF = {"fused-half"}  # greedy text may differ from PyTorch's float32: agreement reported, not required
ONE_A_RUN = "/one-a-run"  # a fused decoder whose waiting prompts are prefilled one a run (--one-prompt-a-run)


def random_texts(count: int, seed: int = 0) -> list[str]:
    """Documents of made-up words: enough distinct pairs for a BPE to fill a vocabulary of thousands."""
    rng = np.random.default_rng(seed)
    letters = np.array(list("abcdefghijklmnopqrstuvwxyz"))
    words = ["".join(rng.choice(letters, size=rng.integers(2, 9))) for _ in range(20_000)]
    return [" ".join(rng.choice(words, size=120)) for _ in range(count)]


def build(preset: str, folder: Path) -> tuple[GPT, Any, Path]:
    params = yaml.safe_load((REPO_ROOT / "params.yaml").read_text())
    shape = params["train"]["presets"][preset]
    tokenizer = tokens.train_tokenizer(random_texts(3000), int(params["tokenize"]["vocab_size"]))
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=tokenizer.get_vocab_size(), **shape)).eval()
    path = folder / "decoder.onnx"
    export_decoder(model, path, int(params["export"]["opset"]))
    decoder_graph.export(model, path.with_name(FILES["fused"]))
    decoder_graph.export(model, path.with_name(FILES["fused-half"]), half=True)
    return model, tokenizer, path


def open_engine(kind: str, model: GPT, tokenizer: Any, path: Path, limits: EngineLimits) -> Engine:
    """``kind``: a decoder's name, ``/one-a-run`` after it: its prompts prefilled one a run."""
    c = model.config
    name, _, one_a_run = kind.partition(ONE_A_RUN)
    onnx = path.with_name(FILES[name]) if name in FILES else path
    decoder = DECODERS[name](str(onnx), CacheShape(c.n_layers, c.n_kv_heads, c.head_dim, c.seq_len), limits.slots)
    decoder.batches_prefills &= not one_a_run
    return Engine(decoder, tokenizer, c.seq_len, limits).start()


def sampling(engine: Engine, prompt: int, new: int) -> SamplingParams:
    """Greedy, exactly ``new`` tokens: refused (one line) where prompt and new exceed the context."""
    return check_sampling(SamplingRequest(new, ignore_eos=True), new, prompt, engine.context)


def run_all(engine: Engine, prompts: list[list[int]], params: SamplingParams, concurrency: int) -> list[Sequence]:
    """Every prompt through the engine, ``concurrency`` clients at a time (a client's error raises here)."""
    with ThreadPoolExecutor(concurrency) as clients:
        return list(clients.map(lambda ids: generate(engine, ids, params, timeout_s=600), prompts))


def check_parity(engine: Engine, model: GPT, vocab: int, prompt: int, new: int) -> tuple[int, float]:
    """Greedy continuations of four random prompts, run together, against PyTorch's (batch 1):
    how many differ, and the share of tokens generated before each one's first difference."""
    rng = np.random.default_rng(1)
    prompts = [rng.integers(0, vocab, size=prompt).tolist() for _ in range(4)]
    results = run_all(engine, prompts, sampling(engine, prompt, new), len(prompts))
    with torch.no_grad():
        expected = [generate_greedy(model, p, new) for p in prompts]
    agreed = [next((i for i, (a, b) in enumerate(zip(got.tokens, want, strict=False)) if a != b), len(want))
              for got, want in zip(results, expected, strict=True)]
    return (sum(got.tokens != want for got, want in zip(results, expected, strict=True)),
            sum(agreed) / sum(len(want) for want in expected))


def measure(engine: Engine, vocab: int, prompt: int, new: int, concurrency: int, vary: int = -1) -> dict[str, float]:
    """``vary``: prompt lengths drawn from ``prompt`` / 2 .. ``prompt``, anew for each value (a
    round's), as traffic brings lengths the engine has not run yet; -1: every prompt ``prompt`` long."""
    requests = max(16, concurrency)
    rng = np.random.default_rng([concurrency, vary + 1])
    lengths = rng.integers(prompt // 2, prompt + 1, requests) if vary >= 0 else [prompt] * requests
    prompts = [rng.integers(0, vocab, size=length).tolist() for length in lengths]
    started = time.perf_counter()
    done = run_all(engine, prompts, sampling(engine, prompt, new), concurrency)
    wall = time.perf_counter() - started
    failed = [str(sequence.finish_reason) for sequence in done if sequence.finish_reason != "length"]
    if failed:
        raise SystemExit(f"concurrency {concurrency}: {len(failed)} requests ended early ({sorted(set(failed))})")
    produced = [len(sequence.tokens) for sequence in done]
    ttft = [sequence.first_token_at - sequence.submitted for sequence in done]
    itl = [(sequence.last_token_at - sequence.first_token_at) / max(1, len(sequence.tokens) - 1) for sequence in done]
    return {"output_tok_s": sum(produced) / wall, "ttft_p50_ms": 1000 * float(np.percentile(ttft, 50)),
            "itl_p50_ms": 1000 * float(np.percentile(itl, 50))}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="cpu-tiny")
    parser.add_argument("--prompt", type=int, default=32, help="prompt tokens")
    parser.add_argument("--new", type=int, default=64, help="new tokens per request")
    parser.add_argument("--concurrency", nargs="+", type=int, default=[1, 8, 32])
    parser.add_argument("--slots", nargs="+", type=int, default=[8], help="the engine's slots (serve.max_slots): "
                        "an engine of each, measured side by side")
    parser.add_argument("--prefill-tokens", type=int,
                        default=yaml.safe_load((REPO_ROOT / "params.yaml").read_text())["serve"]["generate"]["prefill_tokens"],
                        help="prompt tokens prefilled per step (serve.generate.prefill_tokens; 0: whole prompts)")
    parser.add_argument("--rounds", type=int, default=3, help="interleaved rounds (the median is shown)")
    parser.add_argument("--decoders", nargs="+", choices=list(DECODERS), default=["host", "fused", "device"],
                        help="graph: on a CPU it only shows the fixed shape's cost (every slot, the whole context)")
    parser.add_argument("--vary-prompts", action="store_true",
                        help="prompts of --prompt / 2 to --prompt tokens, lengths drawn anew each round")
    parser.add_argument("--one-prompt-a-run", action="store_true",
                        help="beside each fused decoder, the same with its waiting prompts prefilled one a run "
                             "(as before batched prefill)")
    parser.add_argument("--output", type=Path, help="write the figures here as JSON")
    args = parser.parse_args()
    kinds = [*args.decoders, *(f"{kind}{ONE_A_RUN}" for kind in args.decoders
                               if args.one_prompt_a_run and kind in FILES)]

    with tempfile.TemporaryDirectory(prefix="bench-engine-") as tmp:
        model, tokenizer, path = build(args.preset, Path(tmp))
        vocab = model.config.vocab_size
        engines = {f"{kind} {slots}": open_engine(kind, model, tokenizer, path, EngineLimits(
            slots, max(args.concurrency), 16, 600.0, prefill_tokens=args.prefill_tokens))
            for kind in kinds for slots in args.slots}
        provider = next(iter(engines.values())).decoder.session.get_providers()[0]
        print(f"{args.preset}: {sum(p.numel() for p in model.parameters()) / 1e6:.1f}M parameters, context "
              f"{model.config.seq_len}, prompts of {f'{args.prompt // 2}..' if args.vary_prompts else ''}{args.prompt}, "
              f"{args.new} new tokens, {args.prefill_tokens} prompt "
              f"tokens prefilled a step; "
              f"ONNX Runtime on {provider}", flush=True)
        parity = {kind: check_parity(engine, model, vocab, args.prompt, args.new) for kind, engine in engines.items()}
        mismatches = {kind: n for kind, (n, _) in parity.items()}
        print("greedy continuations differing from PyTorch's (of 4; tokens before the first difference): "
              + ", ".join(f"{kind} {n} ({agreed:.0%})" for kind, (n, agreed) in parity.items()), flush=True)
        runs: dict[tuple[str, int], list[dict[str, float]]] = {}
        for engine in engines.values():  # warm-up: first runs allocate and tune
            measure(engine, vocab, args.prompt, args.new, max(args.concurrency))
        for round_ in range(args.rounds):
            for concurrency in args.concurrency:
                for kind, engine in engines.items():
                    runs.setdefault((kind, concurrency), []).append(measure(
                        engine, vocab, args.prompt, args.new, concurrency, round_ if args.vary_prompts else -1))
        for engine in engines.values():
            engine.stop()

    rows = {f"{kind} c{concurrency}": {key: statistics.median(r[key] for r in found) for key in found[0]}
            for (kind, concurrency), found in runs.items()}
    print("| cache | slots | concurrency | output tok/s | TTFT p50 ms | ITL p50 ms |\n|---|---|---|---|---|---|")
    for (kind, concurrency) in runs:
        row = rows[f"{kind} c{concurrency}"]
        cache, slots = kind.split()
        print(f"| {cache} | {slots} | {concurrency} | {row['output_tok_s']:.0f} | {row['ttft_p50_ms']:.2f} "
              f"| {row['itl_p50_ms']:.2f} |")
    if args.output:
        args.output.write_text(json.dumps({"preset": args.preset, "provider": provider, "prompt": args.prompt,
                                           "vary_prompts": args.vary_prompts, "new": args.new, "slots": args.slots,
                                           "prefill_tokens": args.prefill_tokens,
                                           "mismatches": mismatches,
                                           "rows": rows}, indent=1))
    if any(n for kind, n in mismatches.items() if kind.split()[0].partition(ONE_A_RUN)[0] not in HALF):
        sys.exit(1)


if __name__ == "__main__":
    main()
