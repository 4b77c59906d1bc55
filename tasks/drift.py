"""Drift of served traffic: are users asking the champion what it was trained on?

    check    the prompts the capture logged (``serve.capture.uri``) in the window before
             ``--end``, against the champion's training data (the validation split of the
             dataset it was trained on), both read with the champion's tokenizer:
             - token distribution: Jensen-Shannon divergence (bits) of the window's token ids
               from the reference's, beyond what samples of the reference of the same size and
               prompt lengths reach by chance (the largest of ``null_samples``);
             - byte fallback: the share of tokens that are single non-ASCII bytes (text the
               vocabulary never merged: another script, another language), over the reference's;
             - surprise: the champion's perplexity on the prompts over its perplexity on
               reference windows of the same lengths, each starting a document;
             - prompt length (reported).
             Drift when a figure passes its bound (``drift`` in params.yaml). Writes report.json
             and report.html (plots) and pushes the figures to the Pushgateway. The result says
             whether to start a retrain: drift, and no retrain started for this champion within
             ``cooldown_h`` (recorded at ``drift.state_uri``). Too little traffic, no champion:
             no verdict, nothing started, exit 0.
    close    mark a day's capture partition complete (``_SUCCESS``, its record count) once the
             day is over: the served traffic Asset's event (llm_ingest). A day without traffic:
             exit 99, nothing marked, no event.
    show     the newest check's verdict, figures and report (``make drift`` ends with it).
"""

from __future__ import annotations

import argparse
import base64
import datetime as dt
import html
import io
import json
import math
import random
import time
from dataclasses import dataclass
from typing import Any

import numpy as np

from tasks.config import DriftSettings, Settings
from tasks.lib import metrics, storage, tokens
from tasks.lib.errors import GateRejected, StepError
from tasks.lib.params import load_settings
from tasks.lib.step import log, run_step, step_parser

DRIFT, NO_DRIFT, NO_VERDICT = "drift", "no drift", "no verdict"
FIGURE_HELP = {
    "llm_drift_prompts": "Captured prompts the last drift check read",
    "llm_drift_js_bits": "Jensen-Shannon divergence (bits) of the window's token distribution from the champion's training data",
    "llm_drift_js_excess_bits": "That divergence beyond what same-size samples of the training data reach",
    "llm_drift_byte_fallback_excess": "Share of byte-fallback tokens in the window above the training data's",
    "llm_drift_perplexity_ratio": "The champion's perplexity on the prompts over its perplexity on training text of the same lengths",
    "llm_drift_prompt_tokens_p50": "Median prompt length (tokens) in the window",
    "llm_drift_detected": "1 when the last drift check found drift",
    "llm_drift_retrain_requested": "1 when the last drift check started a retrain",
}


# -- reading ------------------------------------------------------------------------------------


def window_records(uri: str, start: dt.datetime, end: dt.datetime) -> list[dict[str, Any]]:
    """The captured records of ``[start, end)`` (their ``time``), answered or not, from the date
    partitions the window touches (parts being written are whole objects: read as they are)."""
    found = []
    day = start.date()
    while day <= end.date():
        for part in storage.list_files(storage.join(uri, f"date={day.isoformat()}")):
            if not part.endswith(".jsonl"):
                continue
            for line in storage.read_bytes(part).splitlines():
                try:
                    record = json.loads(line)
                    inside = start <= dt.datetime.fromisoformat(record["time"]) < end
                except (ValueError, KeyError, TypeError):
                    continue  # a capture line cut or foreign (no time zone...): the check reads what it can
                if inside and isinstance(record.get("prompt"), str) and record["prompt"]:
                    found.append(record)
        day += dt.timedelta(days=1)
    return found


@dataclass
class Reference:
    """The champion's training data as the check reads it: token ids, where documents start.
    Its documents are halved (alternately): the window is compared with half A, and so are
    the chance samples, drawn from half B (samples of A itself would miss A's own sampling
    noise, which the window's comparison has, and read in-distribution traffic as drift)."""

    tokens: np.ndarray
    doc_starts: np.ndarray

    def halves(self) -> tuple[np.ndarray, Reference]:
        """Half A's tokens, and half B (its documents, in the same token array)."""
        ends = np.append(self.doc_starts[1:], len(self.tokens))
        a = np.concatenate([self.tokens[s:e] for s, e in zip(self.doc_starts[::2], ends[::2], strict=True)])
        b = self.doc_starts[1::2] if len(self.doc_starts) > 1 else self.doc_starts
        return a, Reference(self.tokens, b)

    @classmethod
    def of_dataset(cls, dataset_uri: str, max_tokens: int) -> Reference:
        index = storage.read_json(storage.join(dataset_uri, "index.json"))
        split = index["splits"]["val"]
        dtype = np.dtype(index["dtype"])
        count = min(int(split["tokens"]), max_tokens)
        data = b"".join(storage.iter_range(storage.join(dataset_uri, split["bin"]), 0, count * dtype.itemsize))
        ids = np.frombuffer(data, dtype=dtype).astype(np.int64)
        with storage.scratch() as scratch:
            offsets = np.load(storage.download(storage.join(dataset_uri, split["offsets"]), scratch / "offsets.npy"))
        starts = offsets[:-1] if len(offsets) > 1 else np.zeros(1, dtype=np.int64)
        return cls(ids, starts[starts < len(ids) - 1].astype(np.int64))

    def windows(self, lengths: list[int], rng: random.Random) -> list[np.ndarray]:
        """One window per length, each starting a random document (prompts start texts too)."""
        found = []
        for length in lengths:
            start = int(self.doc_starts[rng.randrange(len(self.doc_starts))])
            found.append(self.tokens[start:start + length])
        return found


# -- the figures --------------------------------------------------------------------------------


def byte_fallback_ids(vocab: dict[str, int]) -> np.ndarray:
    """The ids of single-byte tokens of a byte non-ASCII (>= 0x80): byte-level BPE's pieces of a
    character its merges never covered."""
    visible = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    alphabet, extra = {}, 0
    for byte in range(256):  # GPT-2's bytes_to_unicode: visible bytes as themselves, the rest from 256 up
        if byte in visible:
            alphabet[chr(byte)] = byte
        else:
            alphabet[chr(256 + extra)] = byte
            extra += 1
    return np.array(sorted(i for piece, i in vocab.items() if len(piece) == 1 and alphabet.get(piece, 0) >= 0x80),
                    dtype=np.int64)


def distribution(windows: list[np.ndarray], vocab_size: int) -> np.ndarray:
    counts = np.bincount(np.concatenate(windows) if windows else np.zeros(0, dtype=np.int64), minlength=vocab_size)
    return counts.astype(np.float64)


def js_bits(p_counts: np.ndarray, q_counts: np.ndarray) -> float:
    """Jensen-Shannon divergence of two count vectors, in bits (0: the same, 1: disjoint)."""
    p, q = p_counts / max(p_counts.sum(), 1), q_counts / max(q_counts.sum(), 1)
    m = (p + q) / 2

    def kl(a: np.ndarray) -> float:
        nonzero = a > 0
        return float(np.sum(a[nonzero] * np.log2(a[nonzero] / m[nonzero])))

    return (kl(p) + kl(q)) / 2


def share_of(windows: list[np.ndarray], ids: np.ndarray) -> float:
    total = sum(len(w) for w in windows)
    return float(sum(np.isin(w, ids).sum() for w in windows) / total) if total else 0.0


def perplexity(model: Any, windows: list[np.ndarray], context: int) -> float:
    """The model's perplexity on each window's tokens after its first (one window at a time)."""
    import torch

    total, count = 0.0, 0
    with torch.no_grad():
        for window in windows:
            ids = torch.as_tensor(window[-context:], dtype=torch.long)[None]
            if ids.shape[1] < 2:
                continue
            logits = model(ids[:, :-1]).float()
            loss = torch.nn.functional.cross_entropy(logits[0], ids[0, 1:], reduction="sum")
            total, count = total + float(loss), count + ids.shape[1] - 1
    return math.exp(total / count) if count else math.nan


def figures_of(prompts: list[np.ndarray], reference: Reference, fallback: np.ndarray, model: Any, context: int,
               vocab_size: int, settings: DriftSettings, rng: random.Random) -> dict[str, Any]:
    lengths = [len(p) for p in prompts]
    served = distribution(prompts, vocab_size)
    half_a, half_b = reference.halves()
    compared = distribution([half_a], vocab_size)
    null = [js_bits(distribution(half_b.windows(lengths, rng), vocab_size), compared) for _ in range(settings.null_samples)]
    js = js_bits(served, compared)
    same_lengths = reference.windows(lengths, rng)
    fallback_served, fallback_reference = share_of(prompts, fallback), share_of([reference.tokens], fallback)
    ppl_served, ppl_reference = perplexity(model, prompts, context), perplexity(model, same_lengths, context)
    return {
        "prompts": len(prompts), "tokens": int(sum(lengths)),
        "prompt_tokens_p50": float(np.percentile(lengths, 50)), "prompt_tokens_p90": float(np.percentile(lengths, 90)),
        "js_bits": js, "js_null_max_bits": max(null), "js_excess_bits": js - max(null),
        "byte_fallback_share": fallback_served, "byte_fallback_share_reference": fallback_reference,
        "byte_fallback_excess": fallback_served - fallback_reference,
        "perplexity": ppl_served, "perplexity_reference": ppl_reference, "perplexity_ratio": ppl_served / ppl_reference,
    }


def judge(figures: dict[str, Any], settings: DriftSettings) -> list[str]:
    """The bounds passed, one phrase each (empty: no drift)."""
    reasons = []
    if figures["js_excess_bits"] > settings.max_js_excess:
        reasons.append(f"token distribution: JS {figures['js_bits']:.3f} bits, {figures['js_excess_bits']:.3f} beyond "
                       f"same-size samples of the training data (bound {settings.max_js_excess:g})")
    if figures["byte_fallback_excess"] > settings.max_byte_fallback_excess:
        reasons.append(f"byte fallback: {100 * figures['byte_fallback_share']:.1f}% of tokens, the training data "
                       f"{100 * figures['byte_fallback_share_reference']:.2f}% (bound {100 * settings.max_byte_fallback_excess:g} "
                       "points above it)")
    if figures["perplexity_ratio"] > settings.max_perplexity_ratio:
        reasons.append(f"surprise: perplexity {figures['perplexity']:.0f}, {figures['perplexity_ratio']:.1f}x on training "
                       f"text of the same lengths (bound {settings.max_perplexity_ratio:g}x)")
    return reasons


# -- the decision to retrain --------------------------------------------------------------------


def retrain_wanted(settings: DriftSettings, champion: str, now: dt.datetime,
                   report_uri: str) -> tuple[bool, dict[str, Any] | None]:
    """Whether drift may start a retrain now: not when another check started one for this
    champion within the cooldown (a window that stays drifted is one reason, not one per check).
    The state this very check wrote (``report_uri``: a retry of it) does not count."""
    state = storage.read_json(settings.state_uri) if storage.exists(settings.state_uri) else None
    if state and state.get("champion") == champion and state.get("report_uri") != report_uri:
        requested = dt.datetime.fromisoformat(state["requested_at"])
        if now - requested < dt.timedelta(hours=settings.cooldown_h):
            return False, state
    return True, state


# -- the report ---------------------------------------------------------------------------------


def plots(prompts: list[np.ndarray], reference: Reference, vocab: dict[int, str], vocab_size: int) -> str:
    """Two figures as an inline PNG: the most frequent tokens of either side, and prompt lengths."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    served = distribution(prompts, vocab_size)
    whole = distribution([reference.tokens], vocab_size)
    served, whole = served / max(served.sum(), 1), whole / max(whole.sum(), 1)
    top = np.argsort(-(served + whole))[:25]
    fig, (left, right) = plt.subplots(1, 2, figsize=(13, 4.2))
    x = np.arange(len(top))
    left.bar(x - 0.2, whole[top], 0.4, label="training data (val split)")
    left.bar(x + 0.2, served[top], 0.4, label="served prompts")
    left.set_xticks(x, [repr(vocab.get(int(i), "?"))[1:-1][:8] for i in top], rotation=70, fontsize=7)
    left.set_title("the 25 most frequent tokens of either")
    left.legend()
    right.hist([len(p) for p in prompts], bins=30)
    right.set_title("served prompt lengths (tokens)")
    fig.tight_layout()
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=90)
    plt.close(fig)
    return base64.b64encode(buffer.getvalue()).decode()


def render_html(report: dict[str, Any], png: str | None) -> str:
    rows = "".join(f"<tr><td>{html.escape(k)}</td><td>{html.escape(f'{v:.4g}' if isinstance(v, float) else str(v))}</td></tr>"
                   for k, v in report["figures"].items())
    reasons = "".join(f"<li>{html.escape(r)}</li>" for r in report["reasons"]) or "<li>none</li>"
    image = f'<img alt="tokens and lengths" src="data:image/png;base64,{png}">' if png else ""
    return (f"<!doctype html><meta charset='utf-8'><title>drift check {html.escape(report['window']['end'])}</title>"
            "<style>body{font-family:sans-serif;margin:2em}td{padding:2px 10px}</style>"
            f"<h1>Drift check: {html.escape(report['verdict'])}</h1>"
            f"<p>{html.escape(report['outcome'])}</p>"
            f"<p>window {html.escape(report['window']['start'])} .. {html.escape(report['window']['end'])}; champion "
            f"{html.escape(str(report.get('champion')))}; captured traffic {html.escape(report['served_uri'])}</p>"
            f"<h2>Bounds passed</h2><ul>{reasons}</ul><h2>Figures</h2><table>{rows}</table>{image}")


# -- the sub-commands ---------------------------------------------------------------------------


def check(args: argparse.Namespace, settings: Settings) -> dict[str, Any]:
    drift = settings.drift
    end = dt.datetime.fromisoformat(args.end) if args.end else dt.datetime.now(dt.UTC)
    end = end if end.tzinfo else end.replace(tzinfo=dt.UTC)
    hours = args.window_hours or drift.window_h
    start = end - dt.timedelta(hours=hours)
    served_uri = args.served_uri or settings.serve.capture.uri
    window = {"start": start.isoformat(), "end": end.isoformat(), "hours": hours}
    captured = window_records(served_uri, start, end)
    # what is asked, not how often: a prompt asked a thousand times is one prompt of the window
    records = list({r["prompt"]: r for r in captured}.values())
    base: dict[str, Any] = {"window": window, "served_uri": served_uri, "figures": {"prompts": len(records), "requests": len(captured)},
                            "reasons": [],
            "champion": None, "request_retrain": False}
    from tasks.lib.model_store import CHAMPION, alias_version, load_version

    champion = alias_version(settings.pipeline.model_name, CHAMPION)
    if len(records) < drift.min_prompts or champion is None:
        why = (f"no champion of {settings.pipeline.model_name}: nothing to compare with" if champion is None else
               f"{len(records)} distinct captured prompt(s) in the window, fewer than drift.min_prompts {drift.min_prompts}: "
               "too little traffic to judge")
        log.info("drift check %s..%s: no verdict (%s)", start, end, why)
        return finish(args, drift, {**base, "verdict": NO_VERDICT, "outcome": why, "champion": champion}, None)

    rng = random.Random(f"{end.isoformat()}-{champion}")  # the same window, the same samples
    if len(records) > drift.max_prompts:
        records = rng.sample(records, drift.max_prompts)
    loaded = load_version(settings.pipeline.model_name, champion)
    dataset_uri = str(loaded.description.get("dataset_uri") or "")
    if not dataset_uri or not storage.exists(storage.join(dataset_uri, "index.json")):
        raise StepError(f"champion v{champion}: its training dataset {dataset_uri or '(not recorded)'} is gone: "
                        "nothing to compare the traffic with")
    with storage.scratch() as scratch:
        tokenizer = tokens.load_tokenizer(loaded.tokenizer_uri, scratch)
    prompts = [np.asarray(e.ids, dtype=np.int64)
               for e in tokenizer.encode_batch([r["prompt"] for r in records], add_special_tokens=False)]
    prompts = [p for p in prompts if len(p)]
    reference = Reference.of_dataset(dataset_uri, drift.reference_tokens)
    vocab = tokenizer.get_vocab()
    vocab_size = max(tokenizer.get_vocab_size(), int(reference.tokens.max()) + 1)
    figures = figures_of(prompts, reference, byte_fallback_ids(vocab), loaded.model, loaded.model.config.seq_len,
                         vocab_size, drift, rng)
    reasons = judge(figures, drift)
    report = {**base, "figures": {**figures, "requests": len(captured)}, "reasons": reasons, "champion": champion, "dataset_uri": dataset_uri,
              "verdict": DRIFT if reasons else NO_DRIFT}
    if reasons:
        wanted, state = retrain_wanted(drift, champion, end, storage.join(args.output, "report.html"))
        report["request_retrain"] = wanted
        report["outcome"] = ("drift: a retrain is requested (the raw data Asset)" if wanted else
                             f"drift, as at {state['requested_at']} when a retrain was requested for champion "  # type: ignore[index]
                             f"v{champion} (report {state['report_uri']}): none again within {drift.cooldown_h:g}h")  # type: ignore[index]
    else:
        report["outcome"] = "no drift: the traffic reads as the champion's training data"
    png = plots(prompts, reference, {i: t for t, i in vocab.items()}, vocab_size)
    return finish(args, drift, report, png)


def finish(args: argparse.Namespace, drift: DriftSettings, report: dict[str, Any], png: str | None) -> dict[str, Any]:
    report["written_at"] = dt.datetime.now(dt.UTC).isoformat()
    with storage.staged_output(args.output) as out:
        (out / "report.json").write_text(json.dumps(report, indent=1, sort_keys=True))
        (out / "report.html").write_text(render_html(report, png), encoding="utf-8")
    report_uri = storage.join(args.output, "report.html")
    # recorded before the DAG updates the Asset: the next check finds it; this one's retry is not held by it
    if report["request_retrain"]:
        storage.write_bytes(drift.state_uri, json.dumps({
            "champion": report["champion"], "requested_at": report["window"]["end"], "report_uri": report_uri,
            "reasons": report["reasons"]}).encode())
    figures = report["figures"]
    pushed = {f"llm_drift_{k}": figures.get(k) for k in ("prompts", "js_bits", "js_excess_bits", "byte_fallback_excess",
                                                          "perplexity_ratio", "prompt_tokens_p50")}
    metrics.push({"dag_id": drift.dag_id}, {**pushed, "llm_drift_detected": float(report["verdict"] == DRIFT),
                                            "llm_drift_retrain_requested": float(report["request_retrain"])}, FIGURE_HELP)
    log.info("drift check: %s (%s); report %s", report["verdict"], report["outcome"], report_uri)
    return {"verdict": report["verdict"], "outcome": report["outcome"], "request_retrain": report["request_retrain"],
            "window": report["window"],
            "reasons": report["reasons"], "champion": report["champion"], "report_uri": report_uri,
            "figures": {k: v for k, v in figures.items() if isinstance(v, int | float)}}


def close(args: argparse.Namespace, settings: Settings) -> dict[str, Any]:
    day = dt.date.fromisoformat(args.date)
    over = dt.datetime.combine(day + dt.timedelta(days=1), dt.time(), dt.UTC)
    if over > dt.datetime.now(dt.UTC):
        raise StepError(f"--date {day}: the day is not over: its capture partition may still grow")
    # the fronts write what they hold every flush_s: the day's last records land after midnight
    settled = over + dt.timedelta(seconds=3 * settings.serve.capture.flush_s)
    if settled > dt.datetime.now(dt.UTC):
        time.sleep((settled - dt.datetime.now(dt.UTC)).total_seconds())
    partition = storage.join(args.served_uri or settings.serve.capture.uri, f"date={day.isoformat()}")
    parts = [u for u in storage.list_files(partition) if u.endswith(".jsonl")]
    result = {"partition": partition, "parts": len(parts)}
    if not parts:
        raise GateRejected(f"{partition}: no traffic captured that day: nothing to close", {**result, "records": 0})
    records = sum(storage.read_bytes(u).count(b"\n") for u in parts)
    storage.write_bytes(storage.join(partition, storage.SUCCESS_MARKER),
                        json.dumps({"parts": len(parts), "records": records}).encode())
    log.info("closed %s: %d records in %d parts", partition, records, len(parts))
    return {**result, "records": records}


def show(args: argparse.Namespace, settings: Settings) -> dict[str, Any]:
    """The newest drift check's verdict, figures and report (``make drift`` ends with it)."""
    root = storage.join(settings.pipeline.artifact_root, settings.drift.dag_id)
    newest = storage.newest_json(root, "/drift/report.json")
    if newest is None:
        raise StepError(f"{root}: no drift check has run yet")
    uri, report = newest
    figures = report["figures"]
    print(f"{report['verdict'].upper()}: {report['outcome']}")
    window = report["window"]
    print(f"  window      {window['start'][:19]} .. {window['end'][:19]} UTC: {figures.get('prompts', 0)} distinct prompts "
          f"of {figures.get('requests', 0)} captured requests, champion v{report.get('champion')}")
    if "js_bits" in figures:
        print(f"  tokens      JS {figures['js_bits']:.3f} bits ({figures['js_excess_bits']:+.3f} beyond same-size samples "
              f"of the training data); byte fallback {100 * figures['byte_fallback_share']:.1f}% "
              f"(training data {100 * figures['byte_fallback_share_reference']:.2f}%)")
        print(f"  surprise    perplexity {figures['perplexity']:.0f} vs {figures['perplexity_reference']:.0f} on training "
              f"text of the same lengths ({figures['perplexity_ratio']:.1f}x); prompts {figures['prompt_tokens_p50']:.0f} "
              f"tokens (median)")
    for reason in report["reasons"]:
        print(f"  drift       {reason}")
    print(f"  report      {storage.sibling(uri, 'report.html')}")
    return {"verdict": report["verdict"], "request_retrain": report["request_retrain"]}


def main(args: argparse.Namespace) -> dict[str, Any]:
    settings = load_settings()
    if args.overrides:
        raise StepError(f"--set {' '.join(args.overrides)}: use the DAG's Params or params.yaml's drift section")
    return {"check": check, "close": close, "show": show}[args.command](args, settings)


def parser() -> argparse.ArgumentParser:
    p = step_parser("drift", (__doc__ or "").splitlines()[0])
    sub = p.add_subparsers(dest="command", required=True)
    checked = sub.add_parser("check", help="the window's served prompts against the champion's training data")
    checked.add_argument("--end", default="", help="end of the window (ISO date-time, UTC); default: now")
    checked.add_argument("--window-hours", type=float, default=0, help="default: drift.window_h")
    checked.add_argument("--served-uri", default="", help="default: serve.capture.uri")
    checked.add_argument("--output", required=True, help="run-scoped output URI (report.json, report.html)")
    sub.add_parser("show", help="the newest drift check's verdict, figures and report")
    closed = sub.add_parser("close", help="mark a finished day's capture partition complete")
    closed.add_argument("--date", required=True, help="the day (YYYY-MM-DD), over")
    closed.add_argument("--served-uri", default="", help="default: serve.capture.uri")
    return p


if __name__ == "__main__":
    run_step(parser(), main)
