"""Writes the demo suite's data (run once; the files are committed): examples over the demo
domain, the docstrings of installed Python packages that tasks.seed makes the demo corpus of,
taken from past the documents the pipeline's demo runs read (``skip``), so neither training nor
the held-out text holds them.

    PYTHONPATH=. .venvs/runtime/bin/python evaluation/tasks/demo/make_data.py

continuation_choice.jsonl  the first words of a docstring, its next words and three other
                           docstrings' words at the same place (multiple choice, lm-eval ``acc``)
next_word.jsonl            the first words of a docstring and its next word (exact match)
"""

from __future__ import annotations

import json
import random
import re
from pathlib import Path

from tasks.seed import documents

HERE = Path(__file__).parent
SKIP, COUNT, EXAMPLES = 120000, 5000, 100  # past the seed blocks the demo and tests read (24000 each)
CONTEXT_WORDS, CONTINUATION_WORDS = 6, 4


def openings() -> list[list[str]]:
    """The first words of each docstring with enough plain words to make an example."""
    found = []
    for _, doc in documents(SKIP + COUNT, skip=SKIP):
        words = doc.split()[: CONTEXT_WORDS + CONTINUATION_WORDS]
        if len(words) == CONTEXT_WORDS + CONTINUATION_WORDS and re.fullmatch(r"[A-Za-z]+", words[CONTEXT_WORDS]):
            found.append(words)
    return found


def main() -> None:
    rng = random.Random(0)
    pool = openings()
    rng.shuffle(pool)
    unique = list({" ".join(w[:CONTEXT_WORDS]): w for w in pool}.values())
    chosen = unique[:EXAMPLES]
    with (HERE / "continuation_choice.jsonl").open("w") as fh:
        for words in chosen:
            true = " ".join(words[CONTEXT_WORDS:])
            others = [" ".join(o[CONTEXT_WORDS:]) for o in rng.sample(unique[EXAMPLES:], 3)]
            choices = [true, *others]
            rng.shuffle(choices)
            fh.write(json.dumps({"context": " ".join(words[:CONTEXT_WORDS]), "choices": choices,
                                 "label": choices.index(true)}) + "\n")
    with (HERE / "next_word.jsonl").open("w") as fh:
        for words in chosen:
            fh.write(json.dumps({"context": " ".join(words[:CONTEXT_WORDS]), "target": words[CONTEXT_WORDS]}) + "\n")


if __name__ == "__main__":
    main()
