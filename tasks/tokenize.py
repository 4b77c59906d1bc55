"""Distributed tokenization of a snapshot into memory-mappable token files.

Three sub-commands, three kinds of DAG task:

    prepare  pick the tokenizer and the model training starts from: an explicit --tokenizer, else
             a base checkpoint's (--base, train.base: imported once, the line's first run starts
             from it, and so does every run after the base changed), else the production
             model's (a retrain keeps the vocabulary, unless the drift check that started it found
             byte fallback and tokenize.grow_vocabulary lets it grow: then the champion's with
             merges learned on the snapshot's non-ASCII words appended), else train a byte-level
             BPE on the snapshot. Tokenizers are stored content-addressed: {store}/sha256-<hash>/.
    encode   one shard (--shard-index i --num-shards N: a contiguous record range holding about
             1/N of the snapshot's bytes): token ids of each document framed by the model's
             special tokens (BOS where it wants one, EOS), split train/val by document hash. N run in parallel.
    merge    concatenate the N shards in shard order into train.bin / val.bin + offsets +
             index.json. Shards are contiguous and the split is by hash, so the output is
             byte-identical for any N.
"""

from __future__ import annotations

import os

# Rust-side parallelism of encode_batch must be on before tokenizers is imported (2x here).
os.environ.setdefault("TOKENIZERS_PARALLELISM", "true")

import argparse
import json
import shutil
import time
from array import array
from collections import deque
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from tasks.config import Settings, TokenizeSettings
from tasks.contract import to_json
from tasks.lib import storage, tokens
from tasks.lib.errors import StepError
from tasks.lib.params import load_settings
from tasks.lib.step import Progress, log, run_step, step_parser
from tasks.results import BaseRecord, DatasetResult, ShardResult, TokenizerResult

if TYPE_CHECKING:  # base_model imports torch: only a prepare with a base pays for it, not every encode
    from tasks.lib.base_model import BaseModel


@dataclass(frozen=True)
class Production:
    """The production model (MLflow alias ``champion``), pinned to its version: training starts
    from these weights even if another run promotes a new champion meanwhile."""

    model_uri: str  # models:/NAME/VERSION
    tokenizer_uri: str
    base_identity: str  # of the base its line started from ("": the pipeline's own presets)


def champion(model_name: str) -> Production | None:
    if not os.environ.get("MLFLOW_TRACKING_URI"):
        return None
    from tasks.lib.registry import tag_description, version_by_alias

    version = version_by_alias(model_name, "champion")
    if version is None:
        return None  # no registered model or no champion yet
    uri = version.tags.get("tokenizer_uri")
    if not uri:
        raise StepError(f"models:/{model_name}@champion (version {version.version}) has no tokenizer_uri tag")
    base = tag_description(version.tags, f"models:/{model_name}/{version.version}").get("base") or {}
    return Production(f"models:/{model_name}/{version.version}", str(uri), str(base.get("identity", "")))


def start_point(args: argparse.Namespace, settings: Settings, production: Production | None,
                scratch: Path) -> tuple[str, str, BaseModel | None]:
    """(tokenizer URI or "" to train one, its source, the base imported for this run or None)."""
    if args.tokenizer and args.base:
        raise StepError(f"--tokenizer {args.tokenizer} with train.base {args.base}: a base is trained with its own "
                        "tokenizer (leave tokenizer_uri empty, or train.base)")
    if args.tokenizer:
        return args.tokenizer, "explicit", None
    if args.base:
        from tasks.lib.base_model import CheckpointFiles, base_identity, import_base

        seq_len = settings.train.presets[args.preset].seq_len
        files = CheckpointFiles(args.base)
        identity = base_identity(files, seq_len, scratch)
        if production is None or production.base_identity != identity:
            base = import_base(files, identity, seq_len, settings.tokenize.base_store,
                               settings.tokenize.tokenizer_store, scratch)
            return base.tokenizer_uri, "base", base
        log.info("train.base %s: the champion %s descends from it: continuing from the champion", args.base,
                 production.model_uri)
    if production is not None:
        return production.tokenizer_uri, "champion", None
    return "", "trained", None


def growth_wanted(trigger: str, params: TokenizeSettings, production: Production) -> bool:
    """Whether this run grows its champion's vocabulary: the line allows it and the drift check
    that started the run found the drifted prompts falling back to single bytes."""
    if not params.grow_vocabulary:
        return False
    from tasks.drift import started_by

    reasons = started_by(trigger).get("drift_reasons") or []
    if not any(str(r).startswith("byte fallback") for r in reasons):
        return False
    if production.base_identity:  # make drift-loop asks for growth on any line: a base line keeps going
        log.warning("tokenize.grow_vocabulary: the champion %s descends from a Hugging Face base, whose tokenizer "
                    "is kept as it is (growth extends the pipeline's own byte-level BPE)", production.model_uri)
        return False
    return True


def grown(vocabulary: tokens.Vocabulary, snapshot: Path, params: TokenizeSettings) -> tuple[Any, dict[str, str]] | None:
    """The champion's tokenizer grown on the snapshot's text, with its companion files (growth.json
    added); None: the snapshot holds nothing to learn."""
    from tasks.lib.vocabulary_growth import grow

    started = time.perf_counter()
    found = grow(vocabulary.tokenizer, vocabulary.hash, (r["text"] for r in tokens.read_jsonl(snapshot)),
                 params.grow_max_tokens)
    if found is None:
        log.warning("tokenize.grow_vocabulary: the snapshot holds no non-ASCII words the champion's vocabulary "
                    "lacks: the vocabulary stays as it is")
        return None
    tokenizer, growth = found
    log.info("grew the champion's vocabulary %d -> %d tokens (%d merges learned on the snapshot's non-ASCII words "
             "in %.1fs)", growth.first_id, growth.vocab_size, len(growth.pieces), time.perf_counter() - started)
    return tokenizer, {**vocabulary.companions, tokens.GROWTH_FILE: growth.to_json()}


def prepare(args: argparse.Namespace, settings: Settings) -> TokenizerResult:
    params = settings.tokenize
    if args.preset not in settings.train.presets:
        raise StepError(f"--preset {args.preset!r}: expected one of {', '.join(settings.train.presets)}")
    with storage.staged_output(args.output) as out, storage.scratch() as scratch:
        production = champion(settings.pipeline.model_name)
        existing, source, base = start_point(args, settings, production, scratch)
        companions: dict[str, str]  # beside its tokenizer.json: a base's files, a grown one's growth.json
        if existing:
            vocabulary = tokens.load_vocabulary(existing, scratch)
            tokenizer, companions = vocabulary.tokenizer, vocabulary.companions
            if source == "champion" and production and growth_wanted(args.trigger, params, production):
                larger = grown(vocabulary, storage.download(args.snapshot, scratch / "snapshot.jsonl"), params)
                if larger:
                    (tokenizer, companions), source = larger, "grown"
            uri, digest = tokens.store_vocabulary(tokenizer, params.tokenizer_store, companions)
            log.info("%s tokenizer %s (vocab %d)", {"base": "the base checkpoint's", "grown": "the grown"}.get(
                source, f"reusing the {source}"), uri if source == "grown" else existing, tokenizer.get_vocab_size())
        else:
            snapshot = storage.download(args.snapshot, scratch / "snapshot.jsonl")
            count = sum(1 for _ in tokens.read_jsonl(snapshot))
            started = time.perf_counter()
            tokenizer = tokens.train_tokenizer(
                (r["text"] for r in tokens.read_jsonl(snapshot)), params.vocab_size, count
            )
            log.info(
                "trained a byte-level BPE (vocab %d) on %d documents in %.1fs",
                tokenizer.get_vocab_size(), count, time.perf_counter() - started,
            )
            companions = {}
            uri, digest = tokens.store_vocabulary(tokenizer, params.tokenizer_store)
        production_uri = production.model_uri if production else ""
        info = TokenizerResult(
            tokenizer_uri=uri,
            tokenizer_hash=digest,
            tokenizer_source=source,
            champion_model_uri=production_uri,
            # what training starts from (train.init_from: champion): the imported base, else the
            # champion (training checks its architecture and vocabulary are the run's)
            init_model_uri=base.model_uri if base else production_uri,
            base=BaseRecord(base.uri, base.identity) if base else None,
            vocab_size=tokenizer.get_vocab_size(),
            dtype=tokens.token_dtype(tokenizer.get_vocab_size()).name,
        )
        # the tokenizer itself (with a base's special tokens and tokenizer_config.json) beside its
        # description, so dvc.yaml stages can point at a path
        (out / tokens.TOKENIZER_FILE).write_text(tokenizer.to_str(), encoding="utf-8")
        for name, text in companions.items():
            (out / name).write_text(text, encoding="utf-8")
        (out / "info.json").write_text(json.dumps(to_json(info), indent=1))
    return info


def shard_lines(snapshot: str, index: int, num_shards: int, scratch: Path) -> tuple[Iterator[bytes], int, int]:
    """This shard's lines, records ``[start, end)`` of the snapshot (about 1/N of its bytes),
    streamed. With the snapshot's byte offsets (written beside it) only the shard's byte range
    is read, a chunk at a time; without them (older snapshots) the whole file is."""
    offsets_uri = storage.sibling(snapshot, "snapshot.offsets.npy")
    if storage.exists(offsets_uri):
        offsets = np.load(storage.download(offsets_uri, scratch / "snapshot.offsets.npy"))
        start, end = tokens.shard_range(offsets, index, num_shards)
        return tokens.lines_in(storage.iter_range(snapshot, int(offsets[start]), int(offsets[end]))), start, end
    every = storage.download(snapshot, scratch / "snapshot.jsonl").read_bytes().splitlines(keepends=True)
    offsets = tokens.offsets_from_lengths(np.fromiter(map(len, every), dtype=np.int64, count=len(every)))
    start, end = tokens.shard_range(offsets, index, num_shards)
    return iter(every[start:end]), start, end


def encoded_batches(tokenizer: Any, batches: Iterator[list[dict[str, Any]]]) -> Iterator[tuple[list[dict[str, Any]], Any]]:
    """``(records, encodings)`` per batch, in order. The next batch is read, parsed and queued for
    ``encode_batch`` (which releases the GIL and runs on every core) while the caller turns the
    last one into arrays: the cores do not wait for Python between batches (4-6% here)."""
    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="encode") as encoder:
        queued: deque[tuple[list[dict[str, Any]], Future[Any]]] = deque()
        for batch in batches:
            texts = [r["text"] for r in batch]
            queued.append((batch, encoder.submit(tokenizer.encode_batch, texts, add_special_tokens=False)))
            if len(queued) > 1:  # one batch encoding, one waiting behind it
                records, encoding = queued.popleft()
                yield records, encoding.result()
        while queued:
            records, encoding = queued.popleft()
            yield records, encoding.result()


def encode(args: argparse.Namespace, params: TokenizeSettings) -> ShardResult:
    with storage.staged_output(args.output) as out, storage.scratch() as scratch:
        vocabulary = tokens.load_vocabulary(args.tokenizer, scratch)
        tokenizer, frame = vocabulary.tokenizer, vocabulary.special.frame
        dtype = tokens.token_dtype(tokenizer.get_vocab_size())
        lines, start, end = shard_lines(args.snapshot, args.shard_index, args.num_shards, scratch)
        batches = tokens.record_batches(lines, params.batch_bytes, args.snapshot, first_line=start + 1,
                                        required=("text", "content_hash"))
        files = {split: (out / f"{split}.bin").open("wb") for split in tokens.SPLITS}
        lengths = {split: array("q") for split in tokens.SPLITS}  # 8 bytes a document, not a Python int's 36
        progress = Progress(f"encode shard {args.shard_index}/{args.num_shards}", None, "tokens")
        started = time.perf_counter()
        val_fraction = params.val_fraction
        for chunk, encoded in encoded_batches(tokenizer, batches):
            # one array per split and batch: per-document arrays cost ~15% of the throughput
            batch_ids: dict[str, list[int]] = {split: [] for split in tokens.SPLITS}
            for record, enc in zip(chunk, encoded, strict=True):
                split = tokens.split_of(record["content_hash"], val_fraction)
                ids = frame(enc.ids)  # enc.ids is a new Python list on every access: taken once
                batch_ids[split].extend(ids)
                lengths[split].append(len(ids))
            for split, ids in batch_ids.items():
                files[split].write(np.array(ids, dtype=dtype).tobytes())
                progress.update(len(ids))
        for split in tokens.SPLITS:
            files[split].close()
            np.save(out / f"{split}.lengths.npy", np.frombuffer(lengths[split], dtype=np.int64))
        seconds = time.perf_counter() - started
        documents = sum(len(v) for v in lengths.values())
        if documents != end - start:
            raise StepError(f"{args.snapshot}: records {start}-{end} hold {documents} documents, expected {end - start}")
        total = sum(sum(v) for v in lengths.values())
        stats = {
            "shard_index": args.shard_index,
            "num_shards": args.num_shards,
            "records": [start, end],
            "tokens": total,
            "seconds": round(seconds, 3),  # reading, parsing, encoding and writing the shard's records
            "tokens_per_s": round(total / max(seconds, 1e-9)),
        }
        (out / "stats.json").write_text(json.dumps(stats))
    log.info("shard %d/%d: %d documents, %d tokens, %.0f tokens/s", args.shard_index, args.num_shards,
             end - start, total, stats["tokens_per_s"])
    return ShardResult(shard_uri=args.output, shard_index=args.shard_index, num_shards=args.num_shards,
                       records=(start, end), tokens=total, seconds=stats["seconds"], tokens_per_s=stats["tokens_per_s"])


def merge(args: argparse.Namespace, params: TokenizeSettings) -> DatasetResult:
    shard_uris = [storage.join(args.shards, f"{i:05d}") for i in range(args.num_shards)]
    with storage.staged_output(args.output) as out, storage.scratch() as scratch:
        local = [storage.download_tree(uri, scratch / f"{i:05d}") for i, uri in enumerate(shard_uris)]
        shard_stats = [json.loads((d / "stats.json").read_text()) for d in local]
        vocabulary = tokens.load_vocabulary(args.tokenizer, scratch)
        tokenizer = vocabulary.tokenizer
        dtype = tokens.token_dtype(tokenizer.get_vocab_size())
        splits: dict[str, Any] = {}
        for split in tokens.SPLITS:
            with (out / f"{split}.bin").open("wb") as dst:
                for d in local:
                    with (d / f"{split}.bin").open("rb") as src:
                        shutil.copyfileobj(src, dst, 1 << 20)
            lengths = np.concatenate([np.load(d / f"{split}.lengths.npy") for d in local])
            offsets = tokens.offsets_from_lengths(lengths)
            np.save(out / f"{split}.offsets.npy", offsets)
            if (out / f"{split}.bin").stat().st_size != int(offsets[-1]) * dtype.itemsize:
                raise StepError(f"{args.shards}: {split} shards hold a different token count than their lengths")
            splits[split] = {
                "documents": len(lengths),
                "tokens": int(offsets[-1]),
                "bin": f"{split}.bin",
                "offsets": f"{split}.offsets.npy",
                "sha256": storage.sha256_file(out / f"{split}.bin"),
            }
        if splits["train"]["tokens"] == 0:
            raise StepError(f"{args.snapshot}: tokenization produced no training tokens")
        index = {
            "format": "llm-pipeline-tokens/1",
            "dtype": dtype.name,
            "vocab_size": tokenizer.get_vocab_size(),
            "eos_id": vocabulary.special.eos_ids[0],
            "special_tokens": vocabulary.special.to_dict(),
            "tokenizer_uri": args.tokenizer,
            "tokenizer_hash": vocabulary.hash,
            "snapshot_uri": args.snapshot,
            "val_fraction": params.val_fraction,
            "splits": splits,
        }
        (out / "index.json").write_text(json.dumps(index, indent=1, sort_keys=True))
    total = sum(s["tokens"] for s in shard_stats)
    busiest = max(s["seconds"] for s in shard_stats)
    return DatasetResult(
        dataset_uri=args.output,
        index_uri=storage.join(args.output, "index.json"),
        tokens={split: splits[split]["tokens"] for split in tokens.SPLITS},
        documents={split: splits[split]["documents"] for split in tokens.SPLITS},
        dtype=dtype.name,
        tokenizer_hash=vocabulary.hash,
        # shards run in parallel: the slowest one bounds the step
        tokens_per_s=round(total / max(busiest, 1e-9)),
        tokens_per_s_per_worker=tuple(s["tokens_per_s"] for s in shard_stats),
    )


def main(args: argparse.Namespace) -> TokenizerResult | ShardResult | DatasetResult:
    settings = load_settings("tokenize", args.overrides)
    if args.command == "prepare":  # their defaults: params.yaml's
        args.base = settings.train.base if args.base is None else args.base
        args.preset = args.preset or settings.train.preset
    if not storage.exists(args.snapshot):
        raise StepError(f"{args.snapshot}: snapshot not found")
    if args.command == "prepare":
        return prepare(args, settings)
    if args.command == "encode":
        return encode(args, settings.tokenize)
    return merge(args, settings.tokenize)


def parser() -> argparse.ArgumentParser:
    p = step_parser("tokenize", __doc__.splitlines()[0])
    sub = p.add_subparsers(dest="command", required=True)
    for name, text in (("prepare", "pick or train the tokenizer"), ("encode", "tokenize one shard"),
                       ("merge", "merge the shards into the dataset")):
        cmd = sub.add_parser(name, help=text)
        cmd.add_argument("--snapshot", required=True, help="URI of snapshot.jsonl")
        cmd.add_argument("--output", required=True, help="run-scoped output URI")
        if name == "prepare":
            cmd.add_argument(
                "--tokenizer", default="", help="use this tokenizer.json (empty: the base's or the champion's, "
                "else train one)"
            )
            cmd.add_argument("--base", default=None, help="a Hugging Face checkpoint folder or s3:// URI the line "
                             "starts from (default: train.base; empty: none)")
            cmd.add_argument("--preset", default=None, help="the train preset: its seq_len is the context a base "
                             "is trained at (default: train.preset)")
            cmd.add_argument("--trigger", default="", help="the drift check that started the run (JSON, as the "
                             "snapshot step reads it): its byte fallback lets tokenize.grow_vocabulary grow the "
                             "champion's vocabulary")
        else:
            cmd.add_argument("--tokenizer", required=True, help="URI of tokenizer.json")
            cmd.add_argument("--num-shards", type=int, required=True)
        if name == "encode":
            cmd.add_argument("--shard-index", type=int, required=True)
        if name == "merge":
            cmd.add_argument(
                "--shards", required=True, help="URI holding the encode outputs as 00000, 00001, ... (one per shard)"
            )
    # --set must also work after the sub-command
    for action in list(sub.choices.values()):
        action.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    return p


if __name__ == "__main__":
    run_step(parser(), main)
