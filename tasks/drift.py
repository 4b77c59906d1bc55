"""Drift of served traffic: are users asking the champion what it was trained on?

    check    the distinct prompts the capture logged (``serve.capture.uri``) in the window before
             ``--end``, against the champion's training data (the validation split of the
             dataset it was trained on), both read with the champion's tokenizer. Each prompt
             weighs the same, and counts with at most its first ``max_prompt_tokens`` tokens (a
             handful of huge prompts cannot make the figures); the chance baselines are built
             the same way, from training windows of the prompts' (capped) lengths:
             - token distribution: Jensen-Shannon divergence (bits) of the mean of the prompts'
               own token distributions from the reference's, beyond what samples of the
               reference of the same prompt lengths reach by chance (the largest of
               ``null_samples``);
             - byte fallback: the prompts' mean share of tokens that are single non-ASCII bytes
               (text the vocabulary never merged: another script, another language), over the
               reference's;
             - surprise: the champion's perplexity on the prompts (the mean of each prompt's mean
               loss per token) over its perplexity on reference windows of the same lengths, each
               starting a document;
             - prompt length (reported).
             A bound (``drift`` in params.yaml) crossed is drift only when it is seen from at
             least ``min_clients`` distinct clients (the capture's hashed address; none recorded:
             one unknown client): the crossed bounds are judged again without the prompts of
             the ``min_clients`` - 1 clients that drive them most (picked one at a time), and
             must still be crossed; otherwise the verdict is drift from too few clients, and no
             retrain. Writes report.json and report.html (what happened, the bounds, the clients
             that drove it, plots) and pushes the figures to the Pushgateway. The result says
             whether to start a retrain: drift, and no retrain started for this champion within
             ``cooldown_h`` (recorded at ``drift.state_uri``). Too little traffic, no champion:
             no verdict, nothing started, exit 0.
    close    mark a day's capture partition complete (``_SUCCESS``, its record count) once the
             day is over: the served traffic Asset's event (llm_ingest). A day without traffic:
             exit 99, nothing marked, no event.
    show     the newest check's verdict, figures and report (``make drift`` ends with it).
    recheck  the check that started a retrain (``--trigger``: its Asset event's extra, or the run's
             ``drift_report`` Param), again on the same window once the retrain promoted its
             version: each bound before and after, and whether the loop closed (every bound held);
             a bound still crossed says why (a vocabulary that did not grow keeps byte fallback
             where it was). The retrain DAG's ``drift_recheck`` task; its report.json/html beside
             the run's other outputs, the run report quotes it. Not started by a drift check, or
             no version promoted: exit 99.
"""

from __future__ import annotations

import argparse
import base64
import dataclasses
import datetime as dt
import hashlib
import html
import io
import json
import math
import random
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from tasks.config import DriftSettings, Settings
from tasks.lib import metrics, storage, tokens
from tasks.lib.errors import GateRejected, StepError
from tasks.lib.params import load_settings
from tasks.lib.step import log, run_step, step_parser
from tasks.results import (
    DriftCheck,
    DriftClients,
    DriftClosed,
    DriftRecheck,
    DriftShown,
    DriftWindow,
    LoopBound,
    TopClient,
)

DRIFT, NO_DRIFT, NO_VERDICT = "drift", "no drift", "no verdict"
FEW_CLIENTS = "drift from too few clients"  # bounds crossed, but by the prompts of fewer than min_clients clients
UNKNOWN_CLIENT = ""  # a record without a client (captured before clients were, or none known): one client, "unknown"
TOP_CLIENTS = 5  # the clients the report names as driving the drift
FIGURE_HELP = {
    "llm_drift_prompts": "Captured prompts the last drift check read",
    "llm_drift_clients": "Distinct clients (hashed addresses) among the prompts the last drift check read",
    "llm_drift_js_bits": "Jensen-Shannon divergence (bits) of the window's token distribution (each prompt weighing the same) from the champion's training data",
    "llm_drift_js_excess_bits": "That divergence beyond what same-size samples of the training data reach",
    "llm_drift_byte_fallback_excess": "Prompts' mean share of byte-fallback tokens above the training data's",
    "llm_drift_perplexity_ratio": "The champion's perplexity on the prompts over its perplexity on training text of the same lengths",
    "llm_drift_prompt_tokens_p50": "Median prompt length (tokens) in the window",
    "llm_drift_detected": "1 when the last drift check found drift (from at least drift.min_clients clients)",
    "llm_drift_too_few_clients": "1 when the last drift check saw bounds crossed by the prompts of fewer than drift.min_clients clients",
    "llm_drift_retrain_requested": "1 when the last drift check started a retrain",
    "llm_drift_loop_closed": "1 when the drift check, run again after the retrain it started, found every bound held",
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

def distinct_prompts(records: list[dict[str, Any]]) -> tuple[list[str], list[frozenset[str]]]:
    """Each distinct prompt once (what is asked, not how often: a prompt asked a thousand times is
    one prompt of the window), with the clients that asked it (the capture's ``client``, a hashed
    address; a record without one: :data:`UNKNOWN_CLIENT`, all such records one client)."""
    asked: dict[str, set[str]] = {}
    for record in records:
        client = record.get("client")
        asked.setdefault(record["prompt"], set()).add(client if isinstance(client, str) else UNKNOWN_CLIENT)
    return list(asked), [frozenset(clients) for clients in asked.values()]


def checked_prompts(drift_report: str) -> tuple[list[str], dt.datetime]:
    """The distinct captured prompts of the window a drift check read (its report.json beside
    ``drift_report``: window, captured traffic), and the window's end."""
    checked = storage.read_json(storage.sibling(drift_report, "report.json"))
    start, end = (dt.datetime.fromisoformat(checked["window"][k]) for k in ("start", "end"))
    texts, _ = distinct_prompts(window_records(checked["served_uri"], start, end))
    return texts, end


def held_out(prompt: str, fraction: float) -> bool:
    """Whether a captured prompt is in the traffic's held-out slice, by its hash alone: the
    snapshot that may train on the other prompts and the gate that judges on these agree. The
    hash is salted: unsalted it would be the train/val split's (a document's content hash), and
    no prompt trained on could land in the validation split."""
    digest = hashlib.sha256(b"heldout\0" + prompt.encode("utf-8")).hexdigest()
    return tokens.split_of(digest, fraction) == "val"


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
    """The ids of single-byte tokens of a byte non-ASCII (>= 0x80): pieces of a character the
    tokenizer's merges never covered, in byte-level BPE's alphabet (GPT-2, Llama 3, Qwen2) or
    as SentencePiece's byte-fallback tokens ``<0x80>``..``<0xFF>`` (Llama 2, Mistral)."""
    pieces = {f"<0x{byte:02X}>" for byte in range(0x80, 0x100)}
    return np.array(sorted(i for piece, i in vocab.items() if (len(piece) == 1 and tokens.BYTE_LEVEL_ALPHABET.get(piece, 0) >= 0x80)
                           or piece in pieces), dtype=np.int64)


def distribution(windows: list[np.ndarray], vocab_size: int) -> np.ndarray:
    """Token counts: each token weighs the same (the reference's distribution)."""
    counts = np.bincount(np.concatenate(windows) if windows else np.zeros(0, dtype=np.int64), minlength=vocab_size)
    return counts.astype(np.float64)


def prompt_distribution(windows: list[np.ndarray], vocab_size: int) -> np.ndarray:
    """Token counts where each window weighs the same: the sum of the windows' own normalized
    histograms (a prompt of 5,000 tokens counts as much as one of 5)."""
    windows = [w for w in windows if len(w)]
    if not windows:
        return np.zeros(vocab_size)
    weights = np.concatenate([np.full(len(w), 1.0 / len(w)) for w in windows])
    return np.bincount(np.concatenate(windows), weights=weights, minlength=vocab_size)


def js_bits(p_counts: np.ndarray, q_counts: np.ndarray) -> float:
    """Jensen-Shannon divergence of two count vectors, in bits (0: the same, 1: disjoint)."""
    p, q = p_counts / max(p_counts.sum(), 1e-12), q_counts / max(q_counts.sum(), 1e-12)
    m = (p + q) / 2

    def kl(a: np.ndarray) -> float:
        nonzero = a > 0
        return float(np.sum(a[nonzero] * np.log2(a[nonzero] / m[nonzero])))

    return (kl(p) + kl(q)) / 2


def share_of(windows: list[np.ndarray], ids: np.ndarray) -> float:
    """The share of all the windows' tokens among ``ids`` (each token weighs the same)."""
    total = sum(len(w) for w in windows)
    return float(sum(np.isin(w, ids).sum() for w in windows) / total) if total else 0.0


def shares_of(windows: list[np.ndarray], ids: np.ndarray) -> np.ndarray:
    """Each window's own share of tokens among ``ids``."""
    return np.array([float(np.isin(w, ids).mean()) if len(w) else 0.0 for w in windows], dtype=np.float64)


def mean_losses(model: Any, windows: list[np.ndarray], context: int) -> np.ndarray:
    """The model's mean loss (nats per token) on each window's tokens after its first, one window
    at a time (its last ``context`` tokens); nan for a window of fewer than two tokens."""
    import torch

    found = np.full(len(windows), np.nan)
    with torch.no_grad():
        for i, window in enumerate(windows):
            ids = torch.as_tensor(np.asarray(window[-context:]), dtype=torch.long)[None]
            if ids.shape[1] < 2:
                continue
            logits = model(ids[:, :-1]).float()
            found[i] = float(torch.nn.functional.cross_entropy(logits[0], ids[0, 1:]))
    return found


@dataclass(frozen=True, eq=False)  # arrays: compared by identity
class AskedPrompts:
    """The window's distinct prompts (token ids, none empty) and the clients that asked each."""

    prompts: list[np.ndarray]
    clients: list[frozenset[str]]


@dataclass(frozen=True, eq=False)  # arrays: compared by identity
class Vocabulary:
    """The ids the check counts in: how many (the tokenizer's, or more where the reference holds
    higher ids), and those of the byte-fallback tokens (:func:`byte_fallback_ids`)."""

    size: int
    byte_fallback: np.ndarray


@dataclass(frozen=True)
class Champion:
    """The model whose surprise the check measures, and its context (tokens): a window longer
    than that is read by its last ``context`` tokens."""

    model: Any
    context: int


@dataclass
class Traffic:
    """The window's prompts as the check weighs them, each read once: its first
    ``max_prompt_tokens`` token ids, the clients that asked it, its share of byte-fallback tokens,
    the champion's mean loss on it and on a training window of the same length (starting a
    document), and its whole length (reported)."""

    prompts: list[np.ndarray]
    clients: list[frozenset[str]]
    fallback: np.ndarray
    loss: np.ndarray
    reference_loss: np.ndarray
    lengths: np.ndarray

    @classmethod
    def of(cls, asked: AskedPrompts, reference: Reference, fallback: np.ndarray, champion: Champion,
           max_prompt_tokens: int, rng: random.Random) -> Traffic:
        capped = [np.asarray(p[:max_prompt_tokens], dtype=np.int64) for p in asked.prompts]
        same_lengths = reference.windows([len(p) for p in capped], rng)
        model, context = champion.model, champion.context
        return cls(capped, list(asked.clients), shares_of(capped, fallback), mean_losses(model, capped, context),
                   mean_losses(model, same_lengths, context),
                   np.array([len(p) for p in asked.prompts], dtype=np.int64))


BOUNDS = ("token distribution", "byte fallback", "surprise")  # judge()'s phrases start with these names


def excesses(figures: dict[str, Any]) -> dict[str, float]:
    """What each bound judges: the window beyond the reference (0: as the training data; the
    surprise as the log of its ratio). nan (nothing to judge) for a figure without data."""
    ratio = figures["perplexity_ratio"]
    return {"token distribution": figures["js_excess_bits"], "byte fallback": figures["byte_fallback_excess"],
            "surprise": math.log(ratio) if ratio > 0 else math.nan}


def limits(settings: DriftSettings) -> dict[str, float]:
    """The bounds, in :func:`excesses`' units."""
    return {"token distribution": settings.max_js_excess, "byte fallback": settings.max_byte_fallback_excess,
            "surprise": math.log(settings.max_perplexity_ratio)}


def crossed(figures: dict[str, Any], settings: DriftSettings) -> list[str]:
    """The names of the bounds the figures cross (nan crosses none)."""
    found, bound = excesses(figures), limits(settings)
    return [name for name in BOUNDS if found[name] > bound[name]]


def judge(figures: dict[str, Any], settings: DriftSettings) -> list[str]:
    """The bounds crossed, one phrase each (empty: every bound held)."""
    names, reasons = crossed(figures, settings), []
    if "token distribution" in names:
        reasons.append(f"token distribution: JS {figures['js_bits']:.3f} bits, {figures['js_excess_bits']:.3f} beyond "
                       f"same-size samples of the training data (bound {settings.max_js_excess:g})")
    if "byte fallback" in names:
        reasons.append(f"byte fallback: {100 * figures['byte_fallback_share']:.1f}% of tokens, the training data "
                       f"{100 * figures['byte_fallback_share_reference']:.2f}% (bound {100 * settings.max_byte_fallback_excess:g} "
                       "points above it)")
    if "surprise" in names:
        reasons.append(f"surprise: perplexity {figures['perplexity']:.0f}, {figures['perplexity_ratio']:.1f}x on training "
                       f"text of the same lengths (bound {settings.max_perplexity_ratio:g}x)")
    return reasons


def bounds_table(figures: dict[str, Any], settings: DriftSettings) -> list[dict[str, Any]]:
    """Each bound: the figure it judges, its value, the bound, crossed or held (the report's)."""
    names = crossed(figures, settings)
    rows = (("token distribution", "js_excess_bits", settings.max_js_excess),
            ("byte fallback", "byte_fallback_excess", settings.max_byte_fallback_excess),
            ("surprise", "perplexity_ratio", settings.max_perplexity_ratio))
    return [{"bound": name, "figure": key, "value": figures[key], "limit": limit, "crossed": name in names}
            for name, key, limit in rows]


def clamp(value: float) -> float:
    """A figure's excess as far as a bound goes: at most back to the reference (nan: nothing left, 0)."""
    return value if value > 0 else 0.0


class Comparison:
    """The figures of any part of the window (``keep``: a mask over its prompts) against the
    reference. The reference is halved (:meth:`Reference.halves`): the part's token distribution
    is compared with half A, and so are ``null_samples`` samples of half B with the part's prompt
    lengths, each window weighing the same as a prompt does (the chance baseline: the largest).
    A part's token distribution, fallback share and losses are sums of the prompts' own: the
    figures without one client's prompts cost a subtraction, not a new reading."""

    def __init__(self, traffic: Traffic, reference: Reference, fallback: np.ndarray, vocab_size: int,
                 settings: DriftSettings, rng: random.Random) -> None:
        self.traffic, self.vocab_size, self.settings, self.rng = traffic, vocab_size, settings, rng
        half_a, self.half_b = reference.halves()
        self.compared = distribution([half_a], vocab_size)
        self.fallback_reference = share_of([reference.tokens], fallback)
        self.sizes = np.array([len(p) for p in traffic.prompts], dtype=np.int64)
        self.starts = np.concatenate([[0], np.cumsum(self.sizes)])
        self.ids = np.concatenate(traffic.prompts) if traffic.prompts else np.zeros(0, dtype=np.int64)
        self.owner = np.repeat(np.arange(len(self.sizes)), self.sizes)
        self.weight = np.repeat(1.0 / np.maximum(self.sizes, 1), self.sizes)
        self.scored = np.isfinite(traffic.loss) & np.isfinite(traffic.reference_loss)

    def distribution(self, keep: np.ndarray) -> np.ndarray:
        chosen = keep[self.owner]
        return np.bincount(self.ids[chosen], weights=self.weight[chosen], minlength=self.vocab_size)

    def figures(self, keep: np.ndarray) -> dict[str, Any]:
        """The figures of the prompts kept (at least one), the chance baseline drawn for their lengths."""
        kept = np.flatnonzero(keep)
        lengths = [int(n) for n in self.sizes[kept]]
        null = [js_bits(prompt_distribution(self.half_b.windows(lengths, self.rng), self.vocab_size), self.compared)
                for _ in range(self.settings.null_samples)]
        js = js_bits(self.distribution(keep), self.compared)
        fallback = float(self.traffic.fallback[kept].mean())
        scored = keep & self.scored
        loss = float(self.traffic.loss[scored].mean()) if scored.any() else math.nan
        reference_loss = float(self.traffic.reference_loss[scored].mean()) if scored.any() else math.nan
        whole = self.traffic.lengths[kept]
        return {
            "prompts": len(kept), "tokens": int(sum(lengths)),
            "prompts_capped": int((whole > self.settings.max_prompt_tokens).sum()),
            "prompt_tokens_p50": float(np.percentile(whole, 50)), "prompt_tokens_p90": float(np.percentile(whole, 90)),
            "js_bits": js, "js_null_max_bits": max(null), "js_excess_bits": js - max(null),
            "byte_fallback_share": fallback, "byte_fallback_share_reference": self.fallback_reference,
            "byte_fallback_excess": fallback - self.fallback_reference,
            "perplexity": math.exp(loss), "perplexity_reference": math.exp(reference_loss),
            "perplexity_ratio": math.exp(loss - reference_loss),
        }

    def without_each(self, keep: np.ndarray, null_max: float) -> dict[str, tuple[int, dict[str, float]]]:
        """Each client that asked a kept prompt: how many, and the excesses of the kept prompts
        without every one it asked, shared or not (the token distribution's against ``null_max``:
        the baseline is not drawn again for each)."""
        asked: dict[str, list[int]] = {}
        for i in np.flatnonzero(keep):
            for client in self.traffic.clients[i]:
                asked.setdefault(client, []).append(int(i))
        total, count = self.distribution(keep), int(keep.sum())
        fallback = float(self.traffic.fallback[keep].sum())
        scored = keep & self.scored
        loss, reference_loss, scored_count = (float(self.traffic.loss[scored].sum()),
                                              float(self.traffic.reference_loss[scored].sum()), int(scored.sum()))
        found: dict[str, tuple[int, dict[str, float]]] = {}
        for client, prompts in asked.items():
            gone = np.array(prompts, dtype=np.int64)
            left = count - len(gone)
            if left == 0:
                found[client] = (len(gone), dict.fromkeys(BOUNDS, math.nan))
                continue
            tokens = np.concatenate([self.ids[self.starts[i]:self.starts[i + 1]] for i in gone])
            weights = np.repeat(1.0 / self.sizes[gone], self.sizes[gone])
            rest = np.clip(total - np.bincount(tokens, weights=weights, minlength=self.vocab_size), 0, None)
            gone_scored = gone[self.scored[gone]]
            scored_left = scored_count - len(gone_scored)
            surprise = ((loss - float(self.traffic.loss[gone_scored].sum()))
                        - (reference_loss - float(self.traffic.reference_loss[gone_scored].sum()))) / scored_left \
                if scored_left else math.nan
            found[client] = (len(gone), {
                "token distribution": js_bits(rest, self.compared) - null_max,
                "byte fallback": (fallback - float(self.traffic.fallback[gone].sum())) / left - self.fallback_reference,
                "surprise": surprise})
        return found


def attribute(comparison: Comparison, figures: dict[str, Any], names: list[str], settings: DriftSettings) -> dict[str, Any]:
    """Who drove the bounds crossed (``names``), and whether they are seen from at least
    ``min_clients`` distinct clients: the crossed bounds are judged again without the prompts of
    the client that drives them most (the one without whose prompts the crossed figures fall
    furthest, each as a share of the window's excess over the reference), then the next, up to
    ``min_clients`` - 1 clients; drift from enough clients when a bound crossed is still crossed
    then. No group of fewer than ``min_clients`` clients can make drift alone: without its
    prompts, the rest of the window must drift on its own. What is left must hold at least
    ``min_prompts`` prompts to be judged (as a whole window must). A prompt several clients
    asked is one of each's when ranking them, and leaves the window once all of them are gone
    (a prompt that three clients asked is drift seen from three). ``top``: the clients by share
    of the drift (how much of the crossed figures' excess goes without the client's prompts, the
    mean over them, the baseline drawn again for what is left; at most :data:`TOP_CLIENTS`, those
    of 1% or more, and the first in any case): the first is the first removed."""
    clients = comparison.traffic.clients
    everyone = set().union(*clients)
    base = excesses(figures)
    keep = np.ones(len(clients), dtype=bool)

    def share(excess: dict[str, float]) -> float:
        return float(np.mean([min(max(1 - clamp(excess[n]) / max(base[n], 1e-12), 0.0), 1.0) for n in names]))

    options = comparison.without_each(keep, figures["js_null_max_bits"])
    ranked = sorted(options, key=lambda c: (-share(options[c][1]), -options[c][0], c))[:TOP_CLIENTS]
    for client in ranked:  # the top ones again, each with a baseline drawn for what is left without it
        rest = keep & np.array([client not in asked for asked in clients])
        if rest.any():
            options[client] = (options[client][0], excesses(comparison.figures(rest)))
    ranked.sort(key=lambda c: (-share(options[c][1]), -options[c][0], c))
    # a client without whose prompts nothing changes drove nothing: named only when first
    top = [{"client": c, "prompts": options[c][0], "share_of_prompts": options[c][0] / len(clients),
            "share_of_drift": share(options[c][1])} for i, c in enumerate(ranked)
           if i == 0 or share(options[c][1]) >= 0.01]
    removed: list[str] = []
    still, left = list(names), figures
    while still and len(removed) < settings.min_clients - 1 and options:
        removed.append(ranked[0] if not removed else
                       min(options, key=lambda c: (-share(options[c][1]), -options[c][0], c)))
        keep &= np.array([bool(asked - set(removed)) for asked in clients])
        if keep.sum() < settings.min_prompts:
            still, left = [], {"prompts": int(keep.sum())}
            break
        left = comparison.figures(keep)
        still = [n for n in crossed(left, settings) if n in names]
        options = {c: o for c, o in comparison.without_each(keep, left["js_null_max_bits"]).items() if c not in removed}
    return {
        "distinct": len(everyone), "min_clients": settings.min_clients, "seen_from_enough": bool(still),
        "driven_by": None if still else len(removed),  # the bounds hold without the prompts of this many clients
        "removed": removed,
        "without_removed": {"crossed": still, **{k: left[k] for k in ("prompts", "js_excess_bits", "byte_fallback_excess",
                                                                      "perplexity_ratio") if k in left}},
        "top": top,
    }


def client_name(client: str) -> str:
    return client or "(unknown)"


def client_reason(clients: dict[str, Any]) -> str:
    """The verdict's last reason: from how many clients the drift was seen, and who drove it."""
    tops = ", ".join(f"{client_name(t['client'])} {100 * t['share_of_drift']:.0f}% ({t['prompts']} prompts)"
                     for t in clients["top"][:3])
    rule = f"drift.min_clients {clients['min_clients']}; {clients['distinct']} distinct in the window"
    if clients["seen_from_enough"]:
        without = (f": still crossed without the prompts of the {len(clients['removed'])} driving it most"
                   if clients["removed"] else "")
        return f"clients: seen from at least {clients['min_clients']} ({rule}){without}; top by share of the drift: {tops}"
    left = clients["without_removed"]
    held = ("every bound holds" if "js_excess_bits" in left else
            f"{left['prompts']} prompts are left, too few to judge")
    count = clients["driven_by"]
    return (f"clients: drift from too few ({rule}): without the prompts of {count} client{'s' * (count != 1)} "
            f"{held}; top by share of the drift: {tops}")


def assess(asked: AskedPrompts, reference: Reference, vocabulary: Vocabulary, champion: Champion,
           settings: DriftSettings, rng: random.Random) -> dict[str, Any]:
    """The window's prompts and the clients that asked each, judged: figures, bounds, reasons,
    clients, verdict (drift, drift from too few clients, no drift)."""
    fallback = vocabulary.byte_fallback
    traffic = Traffic.of(asked, reference, fallback, champion, settings.max_prompt_tokens, rng)
    comparison = Comparison(traffic, reference, fallback, vocabulary.size, settings, rng)
    figures = comparison.figures(np.ones(len(asked.prompts), dtype=bool))
    figures["clients"] = len(set().union(*asked.clients))
    names, reasons = crossed(figures, settings), judge(figures, settings)
    found: dict[str, Any] = {"distinct": figures["clients"], "min_clients": settings.min_clients}
    verdict = NO_DRIFT
    if names:
        found = attribute(comparison, figures, names, settings)
        reasons.append(client_reason(found))
        verdict = DRIFT if found["seen_from_enough"] else FEW_CLIENTS
    return {"figures": figures, "bounds": bounds_table(figures, settings), "reasons": reasons, "clients": found,
            "verdict": verdict, "traffic": traffic}


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


def heading(report: dict[str, Any]) -> str:
    """What happened, in a line (the report's title)."""
    if report.get("loop"):
        return str(report["loop"]["heading"])
    bounds = report.get("bounds") or []
    count = sum(b["crossed"] for b in bounds)
    clients = report.get("clients") or {}
    if report["verdict"] == NO_VERDICT:
        return f"No verdict: {report['outcome']}"
    if report["verdict"] == NO_DRIFT:
        return f"No drift: all {len(bounds)} bounds held"
    if report["verdict"] == FEW_CLIENTS:
        driven = clients["driven_by"]
        return (f"Drift seen from too few clients: {count} of {len(bounds)} bounds crossed, by the prompts of {driven} "
                f"client{'s' * (driven != 1)} (at least {clients['min_clients']} needed): no retrain")
    return f"Drift: {count} of {len(bounds)} bounds crossed, seen from at least {clients['min_clients']} clients"


def plots(prompts: list[np.ndarray], lengths: np.ndarray, reference: Reference, vocab: dict[int, str],
          vocab_size: int) -> str:
    """Two figures as an inline PNG: the most frequent tokens of either side (each prompt
    weighing the same, as the check weighs them), and prompt lengths."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    served = prompt_distribution(prompts, vocab_size)
    whole = distribution([reference.tokens], vocab_size)
    served, whole = served / max(served.sum(), 1e-12), whole / max(whole.sum(), 1)
    top = np.argsort(-(served + whole))[:25]
    fig, (left, right) = plt.subplots(1, 2, figsize=(13, 4.2))
    x = np.arange(len(top))
    left.bar(x - 0.2, whole[top], 0.4, label="training data (val split)")
    left.bar(x + 0.2, served[top], 0.4, label="served prompts (each weighing the same)")
    left.set_xticks(x, [repr(vocab.get(int(i), "?"))[1:-1][:8] for i in top], rotation=70, fontsize=7)
    left.set_title("the 25 most frequent tokens of either")
    left.legend()
    right.hist(lengths, bins=30)
    right.set_title("served prompt lengths (tokens)")
    fig.tight_layout()
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=90)
    plt.close(fig)
    return base64.b64encode(buffer.getvalue()).decode()


def render_html(report: dict[str, Any], png: str | None) -> str:
    def cell(value: Any) -> str:
        return f"<td>{html.escape(f'{value:.4g}' if isinstance(value, float) else str(value))}</td>"

    rows = "".join(f"<tr><td>{html.escape(k)}</td>{cell(v)}</tr>" for k, v in report["figures"].items())
    bounds = "".join(f"<tr><td>{html.escape(b['bound'])}</td><td>{html.escape(b['figure'])}</td>{cell(b['value'])}"
                     f"{cell(b['limit'])}<td><b>{'crossed' if b['crossed'] else 'held'}</b></td></tr>"
                     for b in report.get("bounds") or [])
    bounds = (f"<h2>Bounds</h2><table><tr><th>bound</th><th>figure</th><th>value</th><th>limit</th><th></th></tr>"
              f"{bounds}</table>") if bounds else ""
    reasons = "".join(f"<li>{html.escape(r)}</li>" for r in report["reasons"])
    reasons = f"<h2>Why</h2><ul>{reasons}</ul>" if reasons else ""
    clients = report.get("clients") or {}
    who = ""
    if clients.get("top"):
        rows_top = "".join(f"<tr><td><code>{html.escape(client_name(t['client']))}</code></td>{cell(t['prompts'])}"
                           f"<td>{100 * t['share_of_prompts']:.1f}%</td><td>{100 * t['share_of_drift']:.0f}%</td></tr>"
                           for t in clients["top"])
        removed = ", ".join(client_name(c) for c in clients["removed"]) or "none"
        who = (f"<h2>Who drove it</h2><p>{clients['distinct']} distinct clients (hashed addresses; records without "
               f"one: <code>(unknown)</code>, one client); drift counts when seen from at least "
               f"{clients['min_clients']}. Judged again without the prompts of {html.escape(removed)}: "
               f"{html.escape(', '.join(clients['without_removed']['crossed']) or 'every bound held')}.</p>"
               "<table><tr><th>client</th><th>prompts</th><th>of the window's</th><th>share of the drift</th></tr>"
               f"{rows_top}</table>")
    image = f'<img alt="tokens and lengths" src="data:image/png;base64,{png}">' if png else ""
    loop = report.get("loop")
    if loop:  # a recheck: the bounds before and after the retrain, and what started it
        rows_loop = "".join(f"<tr><td>{html.escape(b['bound'])}</td><td>{html.escape(b['figure'])}</td>{cell(b['before'])}"
                            f"{cell(b['after'])}{cell(b['limit'])}<td><b>{'crossed' if b['crossed_after'] else 'held'}</b>"
                            f"</td><td>{html.escape(b['why'])}</td></tr>" for b in loop["bounds"])
        bounds = (f"<h2>Before and after the retrain</h2><p>The drift check <code>{html.escape(loop['started_by'])}"
                  f"</code> found {html.escape(loop['verdict_before'])} with v{html.escape(str(loop['champion_before']))}"
                  f"; the same window again with v{html.escape(str(report.get('champion')))}:</p><table><tr><th>bound"
                  f"</th><th>figure</th><th>before</th><th>after</th><th>limit</th><th>now</th><th>why still crossed"
                  f"</th></tr>{rows_loop}</table>") + bounds
    return (f"<!doctype html><meta charset='utf-8'><title>drift check {html.escape(report['window']['end'])}</title>"
            "<style>body{font-family:sans-serif;margin:2em}td,th{padding:2px 10px;text-align:left}</style>"
            f"<h1>{html.escape(heading(report))}</h1>"
            f"<p>{html.escape(report['outcome'])}</p>"
            f"<p>window {html.escape(report['window']['start'])} .. {html.escape(report['window']['end'])}; champion "
            f"{html.escape(str(report.get('champion')))}; captured traffic {html.escape(report['served_uri'])}</p>"
            f"{bounds}{reasons}{who}<h2>Figures</h2><table>{rows}</table>{image}")


# -- the sub-commands ---------------------------------------------------------------------------


def sampled(count: int, most: int, end: dt.datetime) -> list[int]:
    """Which of a window's ``count`` distinct prompts are read: all, or ``most`` of them drawn by
    the window's end alone (the check, its recheck and the gate of the retrain it started read
    the same ones, whatever the champion)."""
    if count <= most:
        return list(range(count))
    return sorted(random.Random(end.isoformat()).sample(range(count), most))


def judged(settings: Settings, window: dict[str, Any], served_uri: str) -> tuple[dict[str, Any], str | None]:
    """The captured prompts of ``window`` (start, end, hours) judged against the champion as it is
    now: the report (figures, bounds, reasons, clients, verdict; no verdict with its outcome when
    the window holds too little traffic or there is no champion) and its plots (inline PNG)."""
    drift = settings.drift
    start, end = dt.datetime.fromisoformat(window["start"]), dt.datetime.fromisoformat(window["end"])
    captured = window_records(served_uri, start, end)
    texts, asked_by = distinct_prompts(captured)
    base: dict[str, Any] = {"window": window, "served_uri": served_uri, "reasons": [], "bounds": [],
                            "figures": {"prompts": len(texts), "requests": len(captured),
                                        "clients": len(set().union(*asked_by))},
                            "clients": {}, "champion": None, "request_retrain": False}
    from tasks.lib.model_store import load_version
    from tasks.lib.registry import CHAMPION, alias_version

    champion = alias_version(settings.pipeline.model_name, CHAMPION)
    if len(texts) < drift.min_prompts or champion is None:
        why = (f"no champion of {settings.pipeline.model_name}: nothing to compare with" if champion is None else
               f"{len(texts)} distinct captured prompt(s) in the window, fewer than drift.min_prompts {drift.min_prompts}: "
               "too little traffic to judge")
        log.info("drift check %s..%s: no verdict (%s)", start, end, why)
        return {**base, "verdict": NO_VERDICT, "outcome": why, "champion": champion}, None

    rng = random.Random(f"{end.isoformat()}-{champion}")  # the same window, the same samples
    chosen = sampled(len(texts), drift.max_prompts, end)
    texts, asked_by = [texts[i] for i in chosen], [asked_by[i] for i in chosen]
    loaded = load_version(settings.pipeline.model_name, champion)
    dataset_uri = str(loaded.description.get("dataset_uri") or "")
    if not dataset_uri or not storage.exists(storage.join(dataset_uri, "index.json")):
        raise StepError(f"champion v{champion}: its training dataset {dataset_uri or '(not recorded)'} is gone: "
                        "nothing to compare the traffic with")
    with storage.scratch() as scratch:
        tokenizer = tokens.load_vocabulary(loaded.tokenizer_uri, scratch).tokenizer
    # a prompt counts with its first max_prompt_tokens tokens: a token is at most a few dozen
    # characters, so a huge prompt's tail is not even encoded (its reported length stops there)
    most = 64 * drift.max_prompt_tokens
    encoded = [np.asarray(e.ids, dtype=np.int64)
               for e in tokenizer.encode_batch([t[:most] for t in texts], add_special_tokens=False)]
    prompts = [p for p in encoded if len(p)]
    asked_by = [c for p, c in zip(encoded, asked_by, strict=True) if len(p)]
    reference = Reference.of_dataset(dataset_uri, drift.reference_tokens)
    vocab = tokenizer.get_vocab()
    vocab_size = max(tokenizer.get_vocab_size(), int(reference.tokens.max()) + 1)
    assessed = assess(AskedPrompts(prompts, asked_by), reference, Vocabulary(vocab_size, byte_fallback_ids(vocab)),
                      Champion(loaded.model, loaded.model.config.seq_len), drift, rng)
    report = {**base, "figures": {**assessed["figures"], "requests": len(captured)}, "reasons": assessed["reasons"],
              "bounds": assessed["bounds"], "clients": assessed["clients"], "champion": champion,
              "dataset_uri": dataset_uri, "tokenizer_uri": loaded.tokenizer_uri,
              "vocab_size": tokenizer.get_vocab_size(), "verdict": assessed["verdict"]}
    traffic = assessed["traffic"]
    png = plots(traffic.prompts, traffic.lengths, reference, {i: t for t, i in vocab.items()}, vocab_size)
    return report, png


def check(args: argparse.Namespace, settings: Settings) -> DriftCheck:
    drift = settings.drift
    end = dt.datetime.fromisoformat(args.end) if args.end else dt.datetime.now(dt.UTC)
    end = end if end.tzinfo else end.replace(tzinfo=dt.UTC)
    hours = args.window_hours or drift.window_h
    window = {"start": (end - dt.timedelta(hours=hours)).isoformat(), "end": end.isoformat(), "hours": hours}
    report, png = judged(settings, window, args.served_uri or settings.serve.capture.uri)
    if report["verdict"] == NO_VERDICT:
        return finish(args, drift, report, None)
    champion, clients = report["champion"], report["clients"]
    if report["verdict"] == DRIFT:
        wanted, state = retrain_wanted(drift, champion, end, storage.join(args.output, "report.html"))
        report["request_retrain"] = wanted
        report["outcome"] = ("drift: a retrain is requested (the raw data Asset)" if wanted else
                             f"drift, as at {state['requested_at']} when a retrain was requested for champion "  # type: ignore[index]
                             f"v{champion} (report {state['report_uri']}): none again within {drift.cooldown_h:g}h")  # type: ignore[index]
    elif report["verdict"] == FEW_CLIENTS:
        count = clients["driven_by"]
        report["outcome"] = (f"drift seen, but from too few clients: without the prompts of {count} "
                             f"client{'s' * (count != 1)} of {clients['distinct']} it is gone (drift.min_clients "
                             f"{drift.min_clients}): no retrain requested")
    else:
        report["outcome"] = "no drift: the traffic reads as the champion's training data"
    return finish(args, drift, report, png)


def client_summary(clients: dict[str, Any]) -> dict[str, Any]:
    """Who drove a verdict, in short (the step's result: the DAG's XCom)."""
    return {k: clients[k] for k in ("distinct", "min_clients", "seen_from_enough", "driven_by", "top") if k in clients}


def drift_clients(clients: dict[str, Any]) -> DriftClients | None:
    """:func:`client_summary` typed (None: nothing was judged, no clients counted)."""
    summary = client_summary(clients)
    if not summary:
        return None
    top = summary.pop("top", None)
    return DriftClients(**summary, top=None if top is None else tuple(TopClient(**client) for client in top))


def write_report(output: str, report: dict[str, Any], png: str | None) -> str:
    """report.json and report.html under ``output`` (committed together); the HTML's URI."""
    report["written_at"] = dt.datetime.now(dt.UTC).isoformat()
    report["heading"] = heading(report)
    with storage.staged_output(output) as out:
        (out / "report.json").write_text(json.dumps(report, indent=1, sort_keys=True))
        (out / "report.html").write_text(render_html(report, png), encoding="utf-8")
    return storage.join(output, "report.html")


def finish(args: argparse.Namespace, drift: DriftSettings, report: dict[str, Any], png: str | None) -> DriftCheck:
    report_uri = write_report(args.output, report, png)
    # recorded before the DAG updates the Asset: the next check finds it; this one's retry is not held by it
    if report["request_retrain"]:
        storage.write_bytes(drift.state_uri, json.dumps({
            "champion": report["champion"], "requested_at": report["window"]["end"], "report_uri": report_uri,
            "reasons": report["reasons"], "clients": client_summary(report["clients"])}).encode())
    figures = report["figures"]
    pushed = {f"llm_drift_{k}": figures.get(k) for k in ("prompts", "clients", "js_bits", "js_excess_bits",
                                                          "byte_fallback_excess", "perplexity_ratio", "prompt_tokens_p50")}
    metrics.push({"line": metrics.line_label(), "dag_id": drift.dag_id}, {**pushed, "llm_drift_detected": float(report["verdict"] == DRIFT),
                                            "llm_drift_too_few_clients": float(report["verdict"] == FEW_CLIENTS),
                                            "llm_drift_retrain_requested": float(report["request_retrain"])}, FIGURE_HELP)
    log.info("drift check: %s (%s); report %s", report["heading"], report["outcome"], report_uri)
    return DriftCheck(verdict=report["verdict"], heading=report["heading"], outcome=report["outcome"],
                      request_retrain=report["request_retrain"], window=DriftWindow(**report["window"]),
                      reasons=tuple(report["reasons"]), clients=drift_clients(report["clients"]),
                      champion=report["champion"], report_uri=report_uri,
                      figures={k: v for k, v in figures.items() if isinstance(v, int | float)})


def close(args: argparse.Namespace, settings: Settings) -> DriftClosed:
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
    if not parts:
        raise GateRejected(f"{partition}: no traffic captured that day: nothing to close",
                           DriftClosed(partition=partition, parts=0, records=0))
    records = sum(storage.read_bytes(u).count(b"\n") for u in parts)
    storage.write_bytes(storage.join(partition, storage.SUCCESS_MARKER),
                        json.dumps({"parts": len(parts), "records": records}).encode())
    log.info("closed %s: %d records in %d parts", partition, records, len(parts))
    return DriftClosed(partition=partition, parts=len(parts), records=records)


def show(args: argparse.Namespace, settings: Settings) -> DriftShown:
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
          f"of {figures.get('requests', 0)} captured requests from {figures.get('clients', 0)} clients, "
          f"champion v{report.get('champion')}")
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
    return DriftShown(verdict=report["verdict"], request_retrain=report["request_retrain"])


# -- after the retrain the drift started: the same window again ---------------------------------

# each bound's figure, and why a retrain can leave it crossed (the run report and the recheck's)
LOOP_FIGURES = (("token distribution", "js_excess_bits"), ("byte fallback", "byte_fallback_excess"),
                ("surprise", "perplexity_ratio"))
STILL_CROSSED = {
    "token distribution": "the traffic's tokens still differ from the new training data's (the drifted domain "
                          "is one part of its mix, and the reference is that mix)",
    "byte fallback": "the vocabulary did not grow (a retrain keeps its champion's tokenizer unless "
                     "tokenize.grow_vocabulary lets it grow): characters it never merged still split into single bytes",
    "surprise": "the new champion is still surprised by the traffic: too little of the drifted domain in its data, "
                "or too few steps on it",
}


def trigger_event(trigger: str) -> dict[str, Any]:
    """A run's ``--trigger`` as given: a JSON object ({} for none or another JSON value); invalid
    JSON is bad input."""
    try:
        found = json.loads(trigger or "{}")
    except json.JSONDecodeError as exc:
        raise StepError(f"--trigger: invalid JSON ({exc.msg})") from None
    return found if isinstance(found, dict) else {}


def completed_from_report(found: dict[str, Any]) -> dict[str, Any]:
    """``found`` (a ``--trigger`` naming a drift check) with the champion, reasons and clients
    read from that check's report.json, unless its Asset event's extra already holds them. A
    report that is missing, or found no drift: bad input."""
    if "champion" in found:  # the Asset event's extra says all that is asked of it
        return found
    report = storage.sibling(str(found["drift_report"]), "report.json")
    if not storage.exists(report):
        raise StepError(f"--trigger: {found['drift_report']}: no drift check's report.json beside it")
    checked = storage.read_json(report)
    if checked.get("verdict") != DRIFT:
        raise StepError(f"--trigger: the drift check {found['drift_report']} found {checked.get('verdict')!r}, not "
                        "drift: there is nothing for a retrain to answer")
    return {"drift_reasons": checked.get("reasons") or [], "drift_clients": client_summary(checked.get("clients") or {}),
            "champion": checked.get("champion"), **found}


def started_by(trigger: str) -> dict[str, Any]:
    """The drift check that started a retrain, from the run's ``--trigger`` (its raw data Asset
    event's extra, or ``{"drift_report": URI}`` from the run's Param), completed from that
    check's report (:func:`completed_from_report`). {}: a run something else started."""
    found = trigger_event(trigger)
    return completed_from_report(found) if found.get("drift_report") else {}


def loop_bounds(before: dict[str, Any], after: dict[str, Any], settings: DriftSettings) -> list[LoopBound]:
    """Each bound on the same window with the champion that drift was found with and the one the
    retrain promoted; a bound still crossed says why (a vocabulary that did not grow: the same
    tokenizer before and after)."""
    limit = {row["figure"]: row["limit"] for row in bounds_table(after["figures"], settings)}
    was, now = set(crossed(before["figures"], settings)), set(crossed(after["figures"], settings))
    grown = before.get("tokenizer_uri") not in (None, after.get("tokenizer_uri"))
    why = {**STILL_CROSSED, "byte fallback": "characters the grown vocabulary still lacks split into single bytes"} \
        if grown else STILL_CROSSED
    return [LoopBound(bound=name, figure=key, before=float(before["figures"][key]), after=float(after["figures"][key]),
                      limit=float(limit[key]), crossed_before=name in was, crossed_after=name in now,
                      why=why[name] if name in now else "")
            for name, key in LOOP_FIGURES]


def moved(bound: LoopBound) -> str:
    """A bound's figure before -> after, in its units, and where it stands."""
    def value(x: float) -> str:
        return {"js_excess_bits": f"{x:+.3f} bits", "byte_fallback_excess": f"{100 * x:+.1f} points",
                "perplexity_ratio": f"{x:.1f}x" if x >= 1 else f"{x:.2g}x"}[bound.figure]  # 0.028x, not 0.0x
    state = "crossed" if bound.crossed_after else "held"
    return f"{bound.bound} {value(bound.before)} -> {value(bound.after)} ({state}, bound {value(bound.limit)})"


def loop_heading(bounds: list[LoopBound], before: str, after: str) -> str:
    still = [b.bound for b in bounds if b.crossed_after]
    was = sum(b.crossed_before for b in bounds)
    if not still:
        return (f"Drift loop closed: all {len(bounds)} bounds held on the same traffic with v{after} "
                f"(v{before}: {was} crossed)")
    return (f"Drift loop not closed: {', '.join(still)} still crossed with v{after} on the same traffic "
            f"(v{before}: {was} crossed)")


def registered_version(registered: str) -> str:
    """The version in the register step's result (JSON), "" where it registered none."""
    try:
        found = json.loads(registered or "null")
    except json.JSONDecodeError as exc:
        raise StepError(f"--registered: invalid JSON ({exc.msg})") from None
    return str(found.get("version") or "") if isinstance(found, dict) else ""


def recheck(args: argparse.Namespace, settings: Settings) -> DriftRecheck:
    """The drift check that started this run, again on its window, with the champion the run
    promoted: did the loop close? Not started by a drift check, this run's version not the
    champion (rejected, rolled back, or another run's promoted since), or the window no longer
    judged (its captured traffic gone): exit 99, the loop stays open."""
    trigger = started_by(args.trigger)
    if not trigger:
        raise GateRejected("this run was not started by the drift check: nothing to check again",
                           DriftRecheck(closed=None, heading="not started by the drift check", started_by=""))
    source = str(trigger["drift_report"])
    if not storage.exists(storage.sibling(source, "report.json")):
        why = f"the drift check's report {source} is gone: the loop cannot be checked"
        raise GateRejected(why, DriftRecheck(closed=None, heading=why, started_by=source))
    before = storage.read_json(storage.sibling(source, "report.json"))
    from tasks.lib.registry import CHAMPION, alias_version

    champion = alias_version(settings.pipeline.model_name, CHAMPION)
    version = registered_version(args.registered)
    open_loop = DriftRecheck(closed=None, heading="", started_by=source, champion_before=str(before["champion"]),
                             champion_after=champion)
    if champion is None or champion != version:
        why = (f"this run's version ({'v' + version if version else 'none registered'}) is not "
               f"the champion (v{champion}): it promoted no version (its outcome says why), and the drift loop "
               "stays open")
        raise GateRejected(why, dataclasses.replace(open_loop, heading=why))
    report, png = judged(settings, before["window"], before["served_uri"])
    if report["verdict"] == NO_VERDICT:
        why = f"the window of {source} can no longer be judged ({report['outcome']}): the drift loop stays open"
        raise GateRejected(why, dataclasses.replace(open_loop, heading=why))
    bounds = loop_bounds(before, report, settings.drift)
    title = loop_heading(bounds, str(before["champion"]), champion)
    report.update(request_retrain=False, outcome="; ".join(moved(b) for b in bounds), loop={
        "heading": title, "closed": not any(b.crossed_after for b in bounds), "started_by": source,
        "champion_before": before["champion"], "verdict_before": before["verdict"],
        "bounds": [dataclasses.asdict(b) for b in bounds]})
    report_uri = write_report(args.output, report, png)
    closed = report["loop"]["closed"]
    # a group of its own: a push replaces its group's metrics, and the check's are the drift DAG's
    metrics.push({"line": metrics.line_label(), "dag_id": settings.pipeline.dag_id, "task": "drift_recheck"},
                 {"llm_drift_loop_closed": float(closed)}, FIGURE_HELP)
    log.info("%s: %s; report %s", title, report["outcome"], report_uri)
    return DriftRecheck(closed=closed, heading=title, started_by=source, champion_before=str(before["champion"]),
                        champion_after=champion, bounds=tuple(bounds), report_uri=report_uri)


def main(args: argparse.Namespace) -> DriftCheck | DriftClosed | DriftShown | DriftRecheck:
    settings = load_settings()
    if args.overrides:
        raise StepError(f"--set {' '.join(args.overrides)}: use the DAG's Params or params.yaml's drift section")
    commands: dict[str, Callable[[argparse.Namespace, Settings], DriftCheck | DriftClosed | DriftShown | DriftRecheck]] = {
        "check": check, "close": close, "show": show, "recheck": recheck}
    return commands[args.command](args, settings)


def parser() -> argparse.ArgumentParser:
    p = step_parser("drift", (__doc__ or "").splitlines()[0])
    sub = p.add_subparsers(dest="command", required=True)
    checked = sub.add_parser("check", help="the window's served prompts against the champion's training data")
    checked.add_argument("--end", default="", help="end of the window (ISO date-time, UTC); default: now")
    checked.add_argument("--window-hours", type=float, default=0, help="default: drift.window_h")
    checked.add_argument("--served-uri", default="", help="default: serve.capture.uri")
    checked.add_argument("--output", required=True, help="run-scoped output URI (report.json, report.html)")
    sub.add_parser("show", help="the newest drift check's verdict, figures and report")
    again = sub.add_parser("recheck", help="the drift check that started this retrain, again on its window with "
                                           "the champion the retrain promoted: did the loop close?")
    again.add_argument("--trigger", default="", help="JSON: the drift check that started the run (its Asset event's "
                                                    "extra, or {\"drift_report\": URI}); {}: exit 99")
    again.add_argument("--registered", default="null", help="JSON: this run's register result (null: none "
                                                           "registered): the loop is checked once its version is "
                                                           "the champion")
    again.add_argument("--output", required=True, help="run-scoped output URI (report.json, report.html)")
    closed = sub.add_parser("close", help="mark a finished day's capture partition complete")
    closed.add_argument("--date", required=True, help="the day (YYYY-MM-DD), over")
    closed.add_argument("--served-uri", default="", help="default: serve.capture.uri")
    return p


if __name__ == "__main__":
    run_step(parser(), main)
