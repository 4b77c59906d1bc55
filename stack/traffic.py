"""Demo traffic for the drift check: completions through the router, as users would send them.

``normal``: the opening words of held-out documents (the text the champion was trained on, never
trained on itself); ``drifted``: the same prompts in another vocabulary (transliterated to Cyrillic
letters: other characters, other bytes, tokens the vocabulary never merged). Then the OpenAI API's
capture is flushed, so the drift check reads them at once.
"""

from __future__ import annotations

import concurrent.futures
import json
import random
import re
import urllib.error
import urllib.request
from typing import Any

CYRILLIC = dict(zip("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ",
                    "абцдефгхийклмнопярстуввхызАБЦДЕФГХИЙКЛМНОПЯРСТУВВХЫЗ", strict=True))
KINDS = ("normal", "drifted")


def prompts(documents: list[str], kind: str, count: int, seed: int = 0) -> list[str]:
    """``count`` prompts: the opening words of documents picked at random (seeded), 4-20 of them;
    3-8 when drifted (a Cyrillic letter is two bytes, each a token of its own: longer prompts
    would not fit the demo model's context of 128 tokens)."""
    rng = random.Random(seed)
    fewest, most = (4, 20) if kind == "normal" else (3, 8)
    texts = [d for d in documents if len(d.split()) >= fewest]
    chosen = []
    for text in rng.choices(texts, k=count):  # the text as written, line breaks and all, to the k-th word's end
        ends = [m.end() for m in re.finditer(r"\S+", text)]
        chosen.append(text[:ends[rng.randint(fewest, min(most, len(ends))) - 1]])
    return chosen if kind == "normal" else ["".join(CYRILLIC.get(c, c) for c in p) for p in chosen]


def post(url: str, model: str, prompt: str, timeout_s: float = 60) -> int:
    body = json.dumps({"model": model, "prompt": prompt, "max_tokens": 8, "stream": True}).encode()
    request = urllib.request.Request(f"{url}/v1/completions", data=body, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as resp:
            resp.read()
            return int(resp.status)
    except urllib.error.HTTPError as exc:  # refused (a 400, a 429): traffic too, and captured
        return int(exc.code)


def send(env: dict[str, str], kind: str, count: int, seed: int = 0) -> dict[str, Any]:
    """Post ``count`` prompts of ``kind`` through the router (4 at a time), then flush the capture."""
    from tasks.config import load
    from tasks.lib import storage

    if kind not in KINDS:
        raise ValueError(f"traffic kind {kind!r}: expected one of {', '.join(KINDS)}")
    settings = load()
    documents = [json.loads(line)["text"] for line in storage.read_bytes(settings.evaluate.eval_set_uri).splitlines()
                 if line.strip()]
    sent = prompts(documents, kind, count, seed)
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        statuses = list(pool.map(lambda p: post(env["ROUTER_URL"], settings.pipeline.model_name, p), sent))
    flush = urllib.request.Request(f"{env['OPENAI_API_URL']}/capture/flush", data=b"", method="POST")
    with urllib.request.urlopen(flush, timeout=120) as resp:
        captured = json.loads(resp.read())
    return {"sent": len(sent), "ok": statuses.count(200), "refused": sum(400 <= s < 500 for s in statuses),
            "failed": sum(s >= 500 for s in statuses), "capture": captured, "example": sent[0]}
