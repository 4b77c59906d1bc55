"""A stand-in for your corpus: a folder of text files and a held-out file, from the docstrings of
the installed Python packages (the text the demo learns from; yours replaces them).

    .venvs/runtime/bin/python -m examples.make_corpus --out /tmp/tutorial --count 1500

writes ``OUT/corpus/NNNNN.txt`` (one document a file: what ``make import SOURCE=OUT/corpus`` reads)
and ``OUT/heldout.jsonl`` (other documents, never imported: the gate's held-out text,
``make retrain EVAL_SET=OUT/heldout.jsonl``).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from tasks.seed import documents


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True, type=Path)
    p.add_argument("--count", type=int, default=1500, help="documents in the corpus (validation wants 1000 or more)")
    p.add_argument("--heldout", type=int, default=200, help="documents held out")
    args = p.parse_args()
    corpus = args.out / "corpus"
    corpus.mkdir(parents=True, exist_ok=True)
    texts = [doc for _, doc in documents(args.count + args.heldout)]
    for number, text in enumerate(texts[:args.count]):
        (corpus / f"{number:05d}.txt").write_text(text, encoding="utf-8")
    with (args.out / "heldout.jsonl").open("w", encoding="utf-8") as fh:
        for text in texts[args.count:]:
            fh.write(json.dumps({"text": text}) + "\n")
    print(f"{min(args.count, len(texts))} documents in {corpus}, {max(0, len(texts) - args.count)} held out in "
          f"{args.out / 'heldout.jsonl'}")


if __name__ == "__main__":
    main()
