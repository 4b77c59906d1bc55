"""A team's Hugging Face checkpoint as the start of a line (train.base), through the real steps:
tokenize prepare imports it once (architecture, tokenizer, special tokens, weights), encode frames
documents with its BOS and EOS, training under torchrun (two processes; FSDP2, DDP and DeepSpeed ZeRO) starts from its
weights, and export's decoder, engine and Hugging Face folder keep its special tokens and chat
template. The checkpoints are built offline by transformers (examples/tiny_base.py): a Llama
with grouped-query attention and an untied head (Llama 3's tokens), a sharded Qwen2 with q/k/v
biases and an embedding padded past its tokenizer."""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import socket
import subprocess
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import safetensors.torch
import torch
from helpers import REPO_ROOT, RUNTIME_PY, error_lines, run_module, step_result, tokenize

from examples.tiny_base import make_base
from tasks.contract import TORCHRUN_MODULE, Rendezvous, torchrun_args
from tasks.lib import hf_checkpoint, storage, tokens
from tasks.lib.model_store import load_model_dir
from tasks.lib.params import load_settings

pytestmark = pytest.mark.torchrun  # training processes, and under torchrun (make test-fast leaves them out)

NO_MLFLOW = {"MLFLOW_TRACKING_URI": ""}
FAMILIES = ("llama", "qwen2")


def texts_of(snapshot: Path) -> list[str]:
    return [r["text"] for r in tokens.read_jsonl(snapshot)]


@pytest.fixture(scope="module")
def bases(snapshot: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("bases")
    return {"llama": make_base("llama", texts_of(snapshot), root / "llama"),
            "qwen2": make_base("qwen2", texts_of(snapshot), root / "qwen2", shard_size="100KB")}


def prepare(snapshot: Path, base: Path | str, stores: Path, out: Path) -> subprocess.CompletedProcess[str]:
    return run_module("tasks.tokenize", "prepare", "--snapshot", str(snapshot), "--base", str(base),
                      "--preset", "cpu-tiny", "--output", str(out), "--set", f"tokenizer_store={stores / 'tokenizers'}",
                      "--set", f"base_store={stores / 'bases'}", env=NO_MLFLOW)


def train_two_processes(dataset: Path, init_from: str, out: Path, *extra: str) -> dict[str, Any]:
    """The train step under torchrun: FSDP2 over two processes (the weights sharded and gathered)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    args = ["--dataset", str(dataset), "--checkpoints", str(out / "ckpt"), "--output", str(out / "model"),
            "--init-from", init_from, "--set", "engine=fsdp2", "--set", "max_steps=4", "--set", "micro_batch=2",
            "--set", "log_every=2", "--set", "eval_every=4", "--set", "eval_batches=1", "--set", "checkpoint_every=4",
            "--set", "warmup_steps=0", *extra]
    proc = subprocess.run([str(RUNTIME_PY), "-m", TORCHRUN_MODULE, *torchrun_args(
        nodes=1, procs_per_node=2, rendezvous=Rendezvous(f"127.0.0.1:{port}", f"base-{port}"), max_restarts=0,
        module="tasks.train", arguments=args)], cwd=REPO_ROOT, capture_output=True, text=True, timeout=600,
        env={**os.environ, "OMP_NUM_THREADS": "1", **NO_MLFLOW})
    assert proc.returncode == 0, proc.stderr[-4000:]
    return step_result(proc)


@pytest.mark.parametrize("family", FAMILIES)
def test_a_base_starts_the_line_with_its_tokenizer_architecture_and_weights(
    family: str, bases: dict[str, Path], snapshot: Path, tmp_path: Path
) -> None:
    base = bases[family]
    first = step_result(prepare(snapshot, base, tmp_path, tmp_path / "prepare-1"))
    assert first["tokenizer_source"] == "base" and first["champion_model_uri"] == ""
    init = str(first["init_model_uri"])
    assert init.startswith(str(tmp_path / "bases" / "sha256-")) and first["base"] == {
        "uri": str(base), "identity": init.rsplit("sha256-", 1)[1]}
    marker = Path(init) / storage.SUCCESS_MARKER
    written = marker.stat().st_mtime_ns
    again = step_result(prepare(snapshot, base, tmp_path, tmp_path / "prepare-2"))
    assert again == first and marker.stat().st_mtime_ns == written  # imported once: found the second time

    # the stored tokenizer is the checkpoint's, with the ids its model frames text with
    vocabulary = tokens.load_vocabulary(str(first["tokenizer_uri"]), tmp_path)
    special = vocabulary.special
    config = json.loads((base / "tokenizer_config.json").read_text())
    assert vocabulary.chat_config is not None and json.loads(vocabulary.chat_config)["chat_template"] == \
        config["chat_template"]
    if family == "llama":  # Llama 3: a BOS its tokenizer's post-processor adds, two EOS ids
        assert special.add_bos and special.bos_id == vocabulary.tokenizer.token_to_id("<|begin_of_text|>")
        assert special.eos_ids == tuple(vocabulary.tokenizer.token_to_id(t) for t in ("<|end_of_text|>", "<|eot_id|>"))
    else:
        assert not special.add_bos and special.eos_ids[0] == vocabulary.tokenizer.token_to_id("<|endoftext|>")

    # every document framed as the model reads text: BOS where it wants one, its EOS last
    tokenize(snapshot, str(first["tokenizer_uri"]), tmp_path / "data", 2)
    index = json.loads((tmp_path / "data" / "dataset" / "index.json").read_text())
    assert index["special_tokens"] == special.to_dict()
    train_bin = np.memmap(tmp_path / "data/dataset/train.bin", dtype=index["dtype"], mode="r")
    offsets = np.load(tmp_path / "data/dataset/train.offsets.npy")
    document = train_bin[offsets[0]:offsets[1]].tolist()
    assert document == special.frame(document[len(special.prefix):-1])

    # lr 0 (FSDP2 for the Llama, DeepSpeed ZeRO for the Qwen2): the model comes out as the
    # checkpoint went in, in the checkpoint's architecture
    engine = {"llama": "fsdp2", "qwen2": "deepspeed"}[family]
    result = train_two_processes(tmp_path / "data" / "dataset", init, tmp_path / "train", "--set", "lr=0",
                                 "--set", f"engine={engine}")
    assert result["initialized_from"] == init and result["world_size"] == 2 and result["engine"] == engine
    trained = load_model_dir(str(result["model_uri"]), tmp_path / "load")
    description = trained.description
    assert description["base"] == first["base"] and description["special_tokens"] == special.to_dict()
    theirs = hf_checkpoint.checkpoint_config(base, 128)
    assert trained.model.config == theirs  # GQA, head size, untied head, biases: the checkpoint's, not the preset's
    assert theirs.n_kv_heads < theirs.n_heads and not theirs.tie_embeddings
    assert theirs.qkv_bias == (family == "qwen2")
    ours = hf_checkpoint.hf_weights(trained.model)
    original = {}
    for file in sorted(base.glob("*.safetensors")):
        original |= safetensors.torch.load_file(file)
    assert set(ours) == set(original) and all(torch.equal(ours[n], original[n]) for n in ours)

    if family == "qwen2":
        return
    # and a run that trains changes them, still in that architecture (DDP: the third engine)
    moved = train_two_processes(tmp_path / "data" / "dataset", init, tmp_path / "train-lr", "--set", "engine=ddp")
    changed = load_model_dir(str(moved["model_uri"]), tmp_path / "load-lr")
    assert changed.model.config == theirs
    assert not torch.equal(changed.model.state_dict()["head.weight"], trained.model.state_dict()["head.weight"])


def test_the_export_keeps_the_bases_special_tokens_and_chat_template(
    bases: dict[str, Path], snapshot: Path, tmp_path: Path
) -> None:
    """The engine stops at either of Llama 3's EOS ids and opens every prompt with its BOS, token
    for token as PyTorch's greedy decoding; the Hugging Face folder says the same and keeps the
    base's tokenizer_config.json (its chat template); transformers reads it to the same logits."""
    from tasks.export import check_decoder, export_decoder, generation_shape, parity_inputs, write_hf_checkpoint

    base = step_result(prepare(snapshot, bases["llama"], tmp_path, tmp_path / "prepare"))
    loaded = load_model_dir(str(base["init_model_uri"]), tmp_path / "load")
    vocabulary = tokens.load_vocabulary(loaded.tokenizer_uri, tmp_path / "tok")
    shape = generation_shape(loaded.model, vocabulary.special)
    assert shape["eos_ids"] == list(vocabulary.special.eos_ids) and shape["bos_id"] == vocabulary.special.bos_id
    eval_text = tmp_path / "eval.jsonl"
    eval_text.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts_of(snapshot)[:20]))
    prompts = ["Return the number of", "Raise ValueError if"]
    inputs = parity_inputs(loaded.model, vocabulary, eval_text, prompts, 6)
    assert all(batch[0][0] == vocabulary.special.bos_id for batch in inputs[:len(prompts)])
    decoder_path = tmp_path / "decoder.onnx"
    export_decoder(loaded.model, decoder_path, 18)
    params = dataclasses.replace(load_settings().export, parity_atol=1e-3, parity_new_tokens=12)
    checked = check_decoder(loaded.model, decoder_path, vocabulary, prompts, inputs[len(prompts):], params)
    assert all(g["prompt_ids"][0] == vocabulary.special.bos_id for g in checked["generations"])

    hf = write_hf_checkpoint(loaded.model, vocabulary, tmp_path / "hf", inputs, 1e-3)
    assert hf["max_abs_logit_diff"] < 1e-3
    written = json.loads((tmp_path / "hf" / "generation_config.json").read_text())
    assert written["eos_token_id"] == list(vocabulary.special.eos_ids) and written["bos_token_id"] == \
        vocabulary.special.bos_id
    assert (tmp_path / "hf" / "tokenizer_config.json").read_text() == (bases["llama"] / "tokenizer_config.json").read_text()

    from tasks.export import check_chat_template
    from tasks.lib.errors import StepError

    check_chat_template(vocabulary)
    broken = json.dumps({**json.loads(vocabulary.chat_config or "{}"), "chat_template": "{% for m in messages %}"})
    with pytest.raises(StepError, match="its chat template cannot serve"):
        check_chat_template(dataclasses.replace(vocabulary, companions={tokens.TOKENIZER_CONFIG_FILE: broken}))


def broken_copy(base: Path, folder: Path) -> Path:
    shutil.copytree(base, folder)
    return folder


def edit_json(path: Path, **changes: Any) -> None:
    path.write_text(json.dumps({**json.loads(path.read_text()), **changes}))


def test_bad_bases_fail_in_one_line_and_import_nothing(bases: dict[str, Path], snapshot: Path, tmp_path: Path) -> None:
    other_family = broken_copy(bases["llama"], tmp_path / "gpt2")
    edit_json(other_family / "config.json", model_type="gpt2")
    missing_shard = broken_copy(bases["qwen2"], tmp_path / "missing-shard")
    (missing_shard / "model-00003-of-00006.safetensors").unlink()
    small_embedding = broken_copy(bases["llama"], tmp_path / "small-embedding")
    edit_json(small_embedding / "config.json", vocab_size=300)
    no_tokenizer = broken_copy(bases["llama"], tmp_path / "no-tokenizer")
    (no_tokenizer / "tokenizer.json").unlink()
    cases = {other_family: "model_type 'gpt2' is not supported",
             missing_shard: "shard model-00003-of-00006.safetensors is missing",
             small_embedding: "has no row in the embedding of 300",
             no_tokenizer: "no tokenizer.json",
             tmp_path / "nowhere": "not a Hugging Face checkpoint folder (no config.json at its root)"}
    for folder, reason in cases.items():
        proc = prepare(snapshot, folder, tmp_path / "stores", tmp_path / f"out-{folder.name}")
        assert proc.returncode == 2, proc.stderr[-2000:]
        lines = error_lines(proc)
        assert len(lines) == 1 and reason in lines[0] and str(folder) in lines[0], lines
        assert not (tmp_path / f"out-{folder.name}").exists()
    assert not list((tmp_path / "stores").rglob(storage.SUCCESS_MARKER))  # no base, no tokenizer stored
    both = run_module("tasks.tokenize", "prepare", "--snapshot", str(snapshot), "--base", str(bases["llama"]),
                      "--tokenizer", str(bases["qwen2"] / "tokenizer.json"), "--output", str(tmp_path / "out-both"),
                      "--set", f"tokenizer_store={tmp_path / 'stores'}", env=NO_MLFLOW)
    assert both.returncode == 2 and "a base is trained with its own tokenizer" in error_lines(both)[0]


def test_a_template_saved_apart_is_the_bases_and_a_changed_weight_file_a_new_base(
    bases: dict[str, Path], snapshot: Path, tmp_path: Path
) -> None:
    """transformers 5 saves the chat template as chat_template.jinja: it is the base's template
    as much as one inside tokenizer_config.json. Weights saved anew under the same names and
    sizes are another base (imported again), a copy of the same files too (their times differ)."""
    base = broken_copy(bases["llama"], tmp_path / "apart")
    config = json.loads((base / "tokenizer_config.json").read_text())
    (base / "chat_template.jinja").write_text(config.pop("chat_template"))
    (base / "tokenizer_config.json").write_text(json.dumps(config))
    first = step_result(prepare(snapshot, base, tmp_path, tmp_path / "p1"))
    vocabulary = tokens.load_vocabulary(str(first["tokenizer_uri"]), tmp_path / "tok")
    assert json.loads(vocabulary.chat_config or "{}")["chat_template"] == (base / "chat_template.jinja").read_text()
    weights = base / "model.safetensors"
    weights.write_bytes(weights.read_bytes())  # the same bytes, written again: a new version of the file
    again = step_result(prepare(snapshot, base, tmp_path, tmp_path / "p2"))
    assert again["init_model_uri"] != first["init_model_uri"] and again["tokenizer_uri"] == first["tokenizer_uri"]


def test_a_base_registered_in_mlflow_is_imported_by_version_or_alias(
    bases: dict[str, Path], snapshot: Path, stack_env: dict[str, str], tmp_path: Path
) -> None:
    """A checkpoint folder logged as a run's artifacts and registered (docs/training.md) is a base
    by models:/NAME/VERSION and by models:/NAME@ALIAS: the same files, the same import (found the
    second time); an alias moved to another version is another base; an absent one is one line."""
    import mlflow

    name = f"base-{tmp_path.name}"[:60]
    client = mlflow.MlflowClient()
    client.create_registered_model(name)
    versions = []
    for family in ("llama", "qwen2"):
        with mlflow.start_run() as run:
            mlflow.log_artifacts(str(bases[family]), artifact_path="checkpoint")
        versions.append(client.create_model_version(name, f"runs:/{run.info.run_id}/checkpoint", run.info.run_id).version)
    client.set_registered_model_alias(name, "base", versions[0])

    def prepared(uri: str, out: str) -> dict[str, Any]:
        proc = run_module("tasks.tokenize", "prepare", "--snapshot", str(snapshot), "--base", uri, "--preset", "cpu-tiny",
                          "--output", str(tmp_path / out), "--set", f"tokenizer_store={tmp_path / 'tokenizers'}",
                          "--set", f"base_store={tmp_path / 'bases'}", env=stack_env)
        assert proc.returncode == 0, proc.stderr[-3000:]
        return step_result(proc)

    by_version = prepared(f"models:/{name}/{versions[0]}", "v")
    by_alias = prepared(f"models:/{name}@base", "a")
    assert by_version["tokenizer_source"] == "base" and by_version["base"]["uri"] == f"models:/{name}/{versions[0]}"
    assert by_alias["init_model_uri"] == by_version["init_model_uri"]  # the same files: imported once
    imported = load_model_dir(str(by_version["init_model_uri"]), tmp_path / "load").model
    assert imported.config == hf_checkpoint.checkpoint_config(bases["llama"], 128)
    client.set_registered_model_alias(name, "base", versions[1])
    moved = prepared(f"models:/{name}@base", "moved")
    assert moved["init_model_uri"] != by_version["init_model_uri"] and moved["tokenizer_uri"] != by_version["tokenizer_uri"]
    for uri, reason in ((f"models:/{name}/99", "not in the registry"),
                        (f"models:/{name}@nobody", "no such model or alias")):
        proc = run_module("tasks.tokenize", "prepare", "--snapshot", str(snapshot), "--base", uri,
                          "--output", str(tmp_path / "absent"), env=stack_env)
        assert proc.returncode == 2 and len(error_lines(proc)) == 1 and reason in error_lines(proc)[0], proc.stderr[-2000:]
        assert uri in error_lines(proc)[0] and not (tmp_path / "absent").exists()


def test_a_base_lines_model_refuses_a_dataset_of_another_tokenizer(
    bases: dict[str, Path], snapshot: Path, tmp_path: Path
) -> None:
    """Starting a base's model on ids of another tokenizer would train nonsense: one line, exit 2."""
    llama = step_result(prepare(snapshot, bases["llama"], tmp_path, tmp_path / "llama"))
    qwen = step_result(prepare(snapshot, bases["qwen2"], tmp_path, tmp_path / "qwen"))
    tokenize(snapshot, str(llama["tokenizer_uri"]), tmp_path / "data", 1)
    proc = run_module("tasks.train", "--dataset", str(tmp_path / "data" / "dataset"), "--checkpoints",
                      str(tmp_path / "ckpt"), "--output", str(tmp_path / "model"), "--init-from",
                      str(qwen["init_model_uri"]), "--set", "engine=single", "--set", "max_steps=1", env=NO_MLFLOW)
    assert proc.returncode == 2
    lines = error_lines(proc)
    assert len(lines) == 1 and "is not the dataset's" in lines[0] and str(bases["qwen2"]) in lines[0], lines
    assert not (tmp_path / "model").exists()
    # init_from scratch: the preset from a random initialization (what its replay rebuilds), no base
    scratch = step_result(run_module(
        "tasks.train", "--dataset", str(tmp_path / "data" / "dataset"), "--checkpoints", str(tmp_path / "ckpt-s"),
        "--output", str(tmp_path / "model-s"), "--init-from", str(llama["init_model_uri"]), "--set", "engine=single",
        "--set", "max_steps=1", "--set", "init_from=scratch", env=NO_MLFLOW))
    described = json.loads((Path(str(scratch["model_uri"])) / "config.json").read_text())
    assert described["base"] is None and scratch["initialized_from"] is None
    assert described["config"]["n_kv_heads"] == described["config"]["n_heads"]  # the preset's, not the base's GQA
