"""A team's Hugging Face checkpoint as the start of a model line (``train.base``).

The tokenize step's ``prepare`` imports a base the first time a line meets it: the checkpoint's
architecture (:func:`tasks.lib.hf_checkpoint.checkpoint_config`), its tokenizer with the special
tokens its model uses and its ``tokenizer_config.json`` (the chat template), stored
content-addressed beside the pipeline's own tokenizers, and its weights as a model folder of
this pipeline's form in ``tokenize.base_store``, named by the base's identity. The next run, and
any other DAG run, finds it there and reads nothing from the checkpoint again; training loads it
as it loads a champion.

``train.base`` names a folder (local or ``s3://``) or a registered MLflow version
(``models:/NAME/VERSION``, ``models:/NAME@ALIAS``) holding the checkpoint's files at its root
(:class:`CheckpointFiles`). A base is known by its identity: the hash of its small files
(configs, tokenizer), its weight files' names and versions, and the context trained. A model trained from it records it (``base``:
uri, identity), and so does each successor: a retrain continues from the champion while the
champion descends from this base, and starts from the base again when the base changed.
"""

from __future__ import annotations

import functools
import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tasks.lib import hf_checkpoint, storage, tokens
from tasks.lib.errors import StepError
from tasks.lib.model import FORMAT_VERSION
from tasks.lib.model_store import save_model_files
from tasks.lib.registry import DESCRIPTION_FILE

# what says which checkpoint a folder holds, besides its weight files (transformers 5 saves the chat
# template as chat_template.jinja beside tokenizer_config.json)
TEMPLATE_FILE = "chat_template.jinja"
IDENTITY_FILES = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
                  TEMPLATE_FILE, "special_tokens_map.json", hf_checkpoint.INDEX_FILE)


@dataclass(frozen=True)
class BaseModel:
    """An imported base: where it came from, and its model folder and tokenizer in our stores."""

    uri: str
    identity: str
    model_uri: str
    tokenizer_uri: str
    tokenizer_hash: str

    @property
    def record(self) -> dict[str, str]:
        """What every model of its line records as its ``base``."""
        return {"uri": self.uri, "identity": self.identity}


class CheckpointFiles:
    """A checkpoint's files where ``train.base`` names them: a folder (local, or ``s3://`` through
    :mod:`tasks.lib.storage`), or a registered MLflow version (``models:/NAME/VERSION`` or
    ``models:/NAME@ALIAS``, the alias resolved once: a checkpoint folder logged as a run's
    artifacts and registered), read through MLflow's artifact API."""

    def __init__(self, uri: str) -> None:
        self.uri = uri
        self.registered = registered_version_uri(uri) if uri.startswith("models:/") else None

    @functools.cached_property
    def versions(self) -> dict[str, str]:
        """Each file by name, with what changes when its content does, without reading it (a
        registered version's files by size: its artifacts are never rewritten). Listed once:
        the identity and the fetch read the same listing."""
        if self.registered is None:
            return storage.file_versions(self.uri)
        import mlflow

        return {f.path.rsplit("/", 1)[-1]: f"{self.registered}:{f.file_size}"
                for f in mlflow.artifacts.list_artifacts(artifact_uri=self.registered) if not f.is_dir}

    def read(self, name: str, scratch: Path) -> bytes:
        if self.registered is None:
            return storage.read_bytes(storage.join(self.uri, name))
        return self.download(name, scratch / "identity").read_bytes()

    def download(self, name: str, folder: Path) -> Path:
        if self.registered is None:
            return storage.download(storage.join(self.uri, name), folder / name)
        import mlflow

        folder.mkdir(parents=True, exist_ok=True)
        return Path(mlflow.artifacts.download_artifacts(artifact_uri=f"{self.registered}/{name}", dst_path=str(folder)))

    @property
    def local(self) -> Path | None:
        """The folder itself, where it is read in place."""
        return Path(self.uri) if self.registered is None and not storage.is_s3(self.uri) else None


def registered_version_uri(uri: str) -> str:
    """``models:/NAME/VERSION`` of a registered base (an alias resolved to its version); absent:
    one line."""
    from tasks.lib.registry import model_version, version_by_alias

    name, at, alias = uri.removeprefix("models:/").partition("@")
    if at:
        found = version_by_alias(name, alias)
        if found is None:
            raise StepError(f"train.base {uri}: no such model or alias in the registry")
        return f"models:/{name}/{found.version}"
    name, _, version = name.rpartition("/")
    if not name or not version.isdigit():
        raise StepError(f"train.base {uri}: expected models:/NAME/VERSION or models:/NAME@ALIAS")
    try:
        model_version(name, version)
    except StepError as exc:
        raise StepError(f"train.base {exc}") from None
    return f"models:/{name}/{version}"


def base_identity(files: CheckpointFiles, seq_len: int, scratch: Path) -> str:
    """The identity of the checkpoint trained at ``seq_len`` tokens: its small files' contents
    and each weight file's version (S3: size and ETag; a local file: size and modification time;
    a registered version: its name, number and sizes), read without reading the weights."""
    versions = files.versions
    if "config.json" not in versions:
        raise StepError(f"train.base {files.uri}: not a Hugging Face checkpoint folder (no config.json at its root)")
    digest = hashlib.sha256(f"seq_len={seq_len}\n".encode())
    for name in IDENTITY_FILES:
        if name in versions:
            digest.update(b"\0" + name.encode() + b"\0" + files.read(name, scratch))
    for name, version in versions.items():
        if name.endswith(".safetensors"):
            digest.update(f"\0{name}\0{version}".encode())
    return digest.hexdigest()


def fetch_checkpoint(files: CheckpointFiles, scratch: Path) -> Path:
    """The checkpoint as a local folder (a local one is read in place): its small files and the
    safetensors the index names (or the one model.safetensors), not the other formats a
    published folder may hold beside them (original/*.pth, *.bin, consolidated.safetensors)."""
    if files.local is not None:
        return files.local
    local = scratch / "base-checkpoint"
    present = files.versions
    for name in IDENTITY_FILES:
        if name in present:
            files.download(name, local)
    index = local / hf_checkpoint.INDEX_FILE
    weights = {hf_checkpoint.SINGLE_FILE}
    if index.exists():
        try:
            weights = set(json.loads(index.read_text())["weight_map"].values())
        except (ValueError, KeyError, TypeError, AttributeError):
            weights = set()  # read_weights names the unreadable index in one line
    for name in sorted(weights):
        if name in present:
            files.download(name, local)
    return local


def read_checkpoint_line(folder: Path, seq_len: int) -> tuple[Any, tokens.SpecialTokens, dict[str, str], Any]:
    """(architecture, special tokens, tokenizer companions, tokenizer) of a checkpoint folder,
    checked against each other; CheckpointError (one line) otherwise."""
    config = hf_checkpoint.checkpoint_config(folder, seq_len)
    tokenizer = hf_checkpoint.checkpoint_tokenizer(folder, config.vocab_size)
    special = hf_checkpoint.checkpoint_special_tokens(folder, tokenizer)
    companions = {tokens.SPECIAL_TOKENS_FILE: json.dumps(special.to_dict(), sort_keys=True)}
    tokenizer_config = with_chat_template(folder)
    if tokenizer_config is not None:
        companions[tokens.TOKENIZER_CONFIG_FILE] = tokenizer_config
    return config, special, companions, tokenizer


def with_chat_template(folder: Path) -> str | None:
    """The checkpoint's tokenizer_config.json, holding its chat template: a ``chat_template.jinja``
    beside it (where transformers 5 saves the template) is folded in, as transformers reads it."""
    path, template = folder / tokens.TOKENIZER_CONFIG_FILE, folder / TEMPLATE_FILE
    if not path.exists():
        return None if not template.exists() else json.dumps({"chat_template": template.read_text(encoding="utf-8")})
    text = path.read_text(encoding="utf-8")
    if not template.exists():
        return text
    try:
        config = json.loads(text)
    except json.JSONDecodeError as exc:
        raise hf_checkpoint.CheckpointError(f"{path}: not JSON ({exc.msg})") from None
    if not isinstance(config, dict):
        raise hf_checkpoint.CheckpointError(f"{path}: not a JSON object")
    return json.dumps({**config, "chat_template": template.read_text(encoding="utf-8")}, indent=1)


def import_base(files: CheckpointFiles, identity: str, seq_len: int, base_store: str, tokenizer_store: str,
                scratch: Path) -> BaseModel:
    """The base (its :func:`base_identity` at ``seq_len``) in our stores, imported unless it
    already is (written once)."""
    uri = files.uri
    folder = storage.join(base_store, f"sha256-{identity}")
    if not storage.exists(storage.join(folder, storage.SUCCESS_MARKER)):
        local = fetch_checkpoint(files, scratch)
        try:
            config, special, companions, tokenizer = read_checkpoint_line(local, seq_len)
            weights = hf_checkpoint.read_weights(local, config)  # one tensor at a time, into our layout
        except hf_checkpoint.CheckpointError as exc:  # named by the user's URI, not the local copy's path
            raise StepError(f"train.base: {str(exc).replace(str(local), uri)}") from None
        tokenizer_uri, tokenizer_hash = tokens.store_vocabulary(tokenizer, tokenizer_store, companions)
        description = {
            "architecture": "gpt", "format_version": FORMAT_VERSION, "config": config.to_dict(),
            "tokenizer_uri": tokenizer_uri, "tokenizer_hash": tokenizer_hash, "eos_id": special.eos_ids[0],
            "special_tokens": special.to_dict(), "base": {"uri": uri, "identity": identity},
            "step": 0, "tokens_seen": 0, "initialized_from": None,
        }
        with storage.staged_output(folder, write_once=True) as out:  # another run's import may win: the same
            save_model_files(weights, description, out)
        del weights
    saved = storage.read_json(storage.join(folder, DESCRIPTION_FILE))
    return BaseModel(uri, identity, folder, str(saved["tokenizer_uri"]), str(saved["tokenizer_hash"]))
