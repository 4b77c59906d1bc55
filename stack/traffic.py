"""Demo traffic for the drift check: completions through the router, as users would send them.

``normal``: the opening words of held-out documents (the text the champion was trained on, never
trained on itself); ``drifted``: the same prompts in another vocabulary (transliterated to Cyrillic
letters: other characters, other bytes, tokens the vocabulary never merged). The prompts come
from ``clients`` users: each its own loopback source address (127.0.0.2, 127.0.0.3, ...: Linux
routes all of 127.0.0.0/8 to ``lo``), which the router sees and the capture records, hashed, as
the prompt's client (the drift check needs drift from ``drift.min_clients`` distinct clients).
Then the OpenAI API's capture is flushed, so the drift check reads them at once.
"""

from __future__ import annotations

import concurrent.futures
import http.client
import ipaddress
import json
import random
import re
import socket
import urllib.parse
import urllib.request
from typing import Any

from tasks.seed import transliterate

KINDS = ("normal", "drifted")
CLIENTS = 6  # source addresses the demo traffic comes from: more than drift.min_clients (3) + the 2 it discounts


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
    return chosen if kind == "normal" else [transliterate(p) for p in chosen]


def sources(url: str, clients: int) -> list[str]:
    """The source addresses of ``clients`` users of ``url``: 127.0.0.2 on when the router is on
    loopback (each a client address of its own), else the system's choice (one client)."""
    host = urllib.parse.urlsplit(url).hostname or "127.0.0.1"
    try:  # an IPv4 address: a loopback source reaches it
        loopback = ipaddress.ip_address(socket.gethostbyname(host)).is_loopback
    except (OSError, ValueError):
        loopback = False
    return [f"127.0.0.{2 + i}" for i in range(clients)] if loopback else [""]


def post(url: str, model: str, prompt: str, timeout_s: float = 60, source: str = "") -> int:
    """A streamed completion of ``prompt`` (its status), from the source address ``source`` ("":
    the system's choice)."""
    body = json.dumps({"model": model, "prompt": prompt, "max_tokens": 8, "stream": True}).encode()
    target = urllib.parse.urlsplit(url)
    host = target.hostname or "127.0.0.1"
    conn = http.client.HTTPConnection(socket.gethostbyname(host) if source else host, target.port or 80,
                                      timeout=timeout_s, source_address=(source, 0) if source else None)
    try:  # refused (a 400, a 429): traffic too, and captured
        conn.request("POST", f"{target.path.rstrip('/')}/v1/completions", body, {"Content-Type": "application/json"})
        resp = conn.getresponse()
        resp.read()
        return int(resp.status)
    finally:
        conn.close()


def send(env: dict[str, str], kind: str, count: int, seed: int = 0, clients: int = CLIENTS) -> dict[str, Any]:
    """Post ``count`` prompts of ``kind`` through the router (4 at a time), the i-th from client
    ``i % clients``, then flush the capture."""
    from tasks.config import load
    from tasks.lib import storage

    if kind not in KINDS:
        raise ValueError(f"traffic kind {kind!r}: expected one of {', '.join(KINDS)}")
    settings = load()
    documents = [json.loads(line)["text"] for line in storage.read_bytes(settings.evaluate.eval_set_uri).splitlines()
                 if line.strip()]
    sent = prompts(documents, kind, count, seed)
    addresses = sources(env["ROUTER_URL"], clients)
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        statuses = list(pool.map(lambda i: post(env["ROUTER_URL"], settings.pipeline.model_name, sent[i],
                                                source=addresses[i % len(addresses)]), range(len(sent))))
    flush = urllib.request.Request(f"{env['OPENAI_API_URL']}/capture/flush", data=b"", method="POST")
    with urllib.request.urlopen(flush, timeout=120) as resp:
        captured = json.loads(resp.read())
    return {"sent": len(sent), "clients": len(addresses), "ok": statuses.count(200),
            "refused": sum(400 <= s < 500 for s in statuses), "failed": sum(s >= 500 for s in statuses),
            "capture": captured, "example": sent[0]}
