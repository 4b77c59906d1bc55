"""Sharded checkpoints with ``torch.distributed.checkpoint`` (DCP), written straight to the
run-scoped checkpoint URI (S3 through fsspec, or a local folder).

- Every rank writes its own shards; DCP's coordinator writes ``.metadata`` last, so a
  checkpoint is *complete* exactly when ``.metadata`` exists. Resume picks the newest complete
  one; a half-written one is ignored (and later deleted by retention).
- Asynchronous saves (the default, in one process as in many) copy the state to CPU memory,
  then write it and finish the checkpoint (completion record, retention) in the background: the
  training loop stalls only for the copy. The CPU buffers are allocated once and reused by every
  save; on a GPU they are pinned and the copy itself runs on a side stream while the next step's
  forward and backward run, so the loop waits only if the copy is not done by that step's
  optimizer update (``before_update``). Across processes saves run on a process group of their
  own (``dcp.async_save`` on the default group mismatches gloo collectives with the loop's).
- Retention keeps the last ``keep_last`` complete checkpoints plus the best by validation loss.
- DCP reshards on load: a checkpoint saved by 2 ranks loads on 1 (or without any process group)
  and the reverse.
- The DeepSpeed engine keeps ZeRO's own partitioned format (``engine.save_checkpoint``): each
  rank writes to a node-local folder and uploads its own files, then rank 0 writes the same
  ``.metadata`` completion marker, so listing, resume and retention are shared. It resumes on
  the same world size (ZeRO partitions are per rank).

Three parts: :class:`CheckpointStore` (where checkpoints live: listing, completion, retention),
a :class:`CheckpointFormat` per engine kind (:class:`DCPFormat`, :class:`DeepSpeedFormat`: how
the state is written and read back; the engine names its own), and :class:`Checkpointer`, which
the trainer calls (cadence bookkeeping: what each save cost the loop).
"""

from __future__ import annotations

import hashlib
import json
import re
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, cast

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed._state_dict_utils import _copy_state_dict, _create_cpu_state_dict
from torch.distributed.checkpoint.staging import AsyncStager
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.checkpoint.state_dict_saver import AsyncSaveResponse

from tasks.lib import storage
from tasks.lib.step import log

if TYPE_CHECKING:
    from tasks.train.engines import Engine

STEP_RE = re.compile(r"/step-(\d{8})/")
METADATA = ".metadata"
META_JSON = "trainer.json"


def _writer(uri: str) -> Any:
    if storage.is_s3(uri):
        from torch.distributed.checkpoint._fsspec_filesystem import FsspecWriter

        return FsspecWriter(uri)
    return dcp.FileSystemWriter(uri)


def _reader(uri: str) -> Any:
    if storage.is_s3(uri):
        from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader

        return FsspecReader(uri)
    return dcp.FileSystemReader(uri)


@dataclass(frozen=True)
class CheckpointInfo:
    uri: str
    step: int
    trainer: dict[str, Any]


def list_complete(root: str) -> list[CheckpointInfo]:
    """Complete checkpoints under ``root``, oldest first."""
    files = storage.list_files(root)
    steps = sorted({int(m.group(1)) for f in files if (m := STEP_RE.search(f)) and f.endswith("/" + METADATA)})
    out = []
    for step in steps:
        uri = step_uri(root, step)
        meta_uri = storage.join(uri, META_JSON)
        trainer = storage.read_json(meta_uri) if meta_uri in files else {"step": step}
        out.append(CheckpointInfo(uri=uri, step=step, trainer=trainer))
    return out


def step_uri(root: str, step: int) -> str:
    return storage.join(root, f"step-{step:08d}")


class CheckpointStore:
    """The checkpoints of one run under ``root``: which are complete, and which to keep."""

    def __init__(self, root: str, keep_last: int, rank: int) -> None:
        self.root, self.keep_last, self.rank = root, keep_last, rank

    def latest(self) -> CheckpointInfo | None:
        complete = list_complete(self.root)
        return complete[-1] if complete else None

    def info(self, trainer: dict[str, Any]) -> CheckpointInfo:
        return CheckpointInfo(step_uri(self.root, trainer["step"]), trainer["step"], dict(trainer))

    def finish(self, info: CheckpointInfo) -> None:
        """After the format wrote it: the trainer record, then retention (rank 0)."""
        if self.rank != 0:
            return
        storage.write_bytes(storage.join(info.uri, META_JSON), json.dumps(info.trainer, sort_keys=True).encode())
        log.info("checkpoint step %d complete: %s", info.step, info.uri)
        self._apply_retention()

    def _apply_retention(self) -> None:
        """The last ``keep_last`` complete checkpoints, plus the best by validation loss."""
        complete = list_complete(self.root)
        keep = {c.step for c in complete[-self.keep_last :]}
        scored = [c for c in complete if c.trainer.get("val_loss") is not None]
        if scored:
            keep.add(min(scored, key=lambda c: c.trainer["val_loss"]).step)
        newest = complete[-1].step if complete else -1
        on_disk = {int(m.group(1)) for f in storage.list_files(self.root) if (m := STEP_RE.search(f))}
        for step in sorted(on_disk - keep):
            if step < newest:  # never touch one that may still be being written
                storage.delete_tree(step_uri(self.root, step))


class CheckpointFormat(Protocol):
    """How an engine's training state is written into a checkpoint folder and read back."""

    def save(self, engine: Engine, info: CheckpointInfo, store: CheckpointStore,
             completed: Callable[[], None]) -> Future[None] | None:
        """Write it; the store's ``finish`` once complete. None: complete on return; else the
        background half, which calls ``completed`` when the checkpoint is complete."""

    def before_update(self) -> float:
        """Before the optimizer changes the weights: wait for the last save's copy of them;
        the seconds waited."""

    def load(self, engine: Engine, info: CheckpointInfo, trainer: dict[str, Any]) -> dict[str, Any]:
        """Restore the engine from ``info``; the trainer state saved with it (``trainer``: its keys)."""

    def close(self) -> None:
        """Free buffers and threads (after the last save completed)."""


class PinnedStager(AsyncStager):
    """DCP's AsyncStager: copies a save's tensors into CPU buffers that the first save allocates
    and every later save reuses (a GPU save used to allocate and fill fresh pageable memory: 0.73 s
    per checkpoint of the gpu-125m preset on an H100). On a GPU the buffers are pinned and filled
    on a side stream from a background thread, overlapping the next step's forward and backward;
    the loop waits for the copy before its optimizer update (``Checkpointer.before_update``).
    Built on the helpers of DCP's own caching stager (DefaultStager's deep copy of our training
    state failed on the H100 here, torch 2.11: KeyError <class 'type'>)."""

    _synchronize_after_execute = False  # the caller waits, through the returned Future

    def __init__(self) -> None:
        self.on_gpu = torch.cuda.is_available()
        self._buffers: dict[str, Any] | None = None
        self._stream = torch.cuda.Stream() if self.on_gpu else None
        self._copier = ThreadPoolExecutor(max_workers=1, thread_name_prefix="checkpoint-stage") if self.on_gpu else None

    def stage(self, state_dict: dict[str, Any]) -> dict[str, Any] | Future[dict[str, Any]]:
        if self._stream is None or self._copier is None:
            return self._copy(state_dict)
        self._stream.wait_stream(torch.cuda.current_stream())  # after the kernels of the last update
        return self._copier.submit(self._copy, state_dict)

    def _copy(self, state_dict: dict[str, Any]) -> dict[str, Any]:
        if self._buffers is None:
            self._buffers = _create_cpu_state_dict(state_dict, pin_memory=self.on_gpu)
        if self._stream is None:
            return cast("dict[str, Any]", _copy_state_dict(state_dict, self._buffers))
        with torch.cuda.stream(self._stream):
            staged = _copy_state_dict(state_dict, self._buffers, non_blocking=True)
        self._stream.synchronize()
        return cast("dict[str, Any]", staged)

    def synchronize_staging(self) -> None:
        """Nothing to do: stage's Future says when the copy is done."""

    def close(self) -> None:
        if self._copier is not None:
            self._copier.shutdown()
        self._buffers = None


class DCPFormat:
    """torch.distributed.checkpoint: model, optimizer and trainer state in one sharded save,
    resharded on load. Asynchronous by default (see the module's doc)."""

    def __init__(self, async_save: bool) -> None:
        self.async_save = async_save
        self._group = dist.new_group(backend="gloo") if async_save and dist.is_initialized() else None
        self._stager = PinnedStager() if async_save else None
        self._staging: Future[None] | None = None  # the copy of the last save, when in the background
        # the background half of an asynchronous save: its write, then the store's finish
        self._background = ThreadPoolExecutor(max_workers=1, thread_name_prefix="checkpoint")

    def save(self, engine: Engine, info: CheckpointInfo, store: CheckpointStore,
             completed: Callable[[], None]) -> Future[None] | None:
        model_sd, optim_sd = get_state_dict(engine.model, engine.optimizer)
        # the trainer state (step, data position) travels inside the checkpoint: complete together
        state = {"model": model_sd, "optim": optim_sd, "trainer": dict(info.trainer)}
        if not self.async_save:
            dcp.save(state, storage_writer=_writer(info.uri))
            store.finish(info)
            return None
        # every tensor is copied to the stager's CPU buffers before the next optimizer update may
        # change the weights in place (a test holds the write back): in the loop on a CPU, in
        # the background on a GPU (an AsyncSaveResponse then; the loop calls before_update)
        response = dcp.async_save(state, storage_writer=_writer(info.uri), process_group=self._group,
                                  async_stager=self._stager, no_dist=not dist.is_initialized())
        if isinstance(response, AsyncSaveResponse):
            self._staging, written = response.staging_completion, response.upload_completion
        else:
            written = cast("Future[Any]", response)

        def complete() -> None:
            written.result()
            store.finish(info)
            completed()

        return self._background.submit(complete)

    def before_update(self) -> float:
        if self._staging is None:
            return 0.0
        started = time.perf_counter()
        staging, self._staging = self._staging, None
        staging.result()
        return time.perf_counter() - started

    def load(self, engine: Engine, info: CheckpointInfo, trainer: dict[str, Any]) -> dict[str, Any]:
        model_sd, optim_sd = get_state_dict(engine.model, engine.optimizer)
        state: dict[str, Any] = {"model": model_sd, "optim": optim_sd, "trainer": dict(trainer)}
        dcp.load(state, storage_reader=_reader(info.uri))
        set_state_dict(engine.model, engine.optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
        loaded: dict[str, Any] = state["trainer"]
        return loaded

    def close(self) -> None:
        self._background.shutdown()
        if self._stager is not None:
            self._stager.close()


class DeepSpeedFormat:
    """ZeRO's partitioned files (``engine.save_checkpoint``), staged on local disk for S3: each
    rank uploads the partitions it wrote, rank 0 the shared states and the ``.metadata`` marker.
    Synchronous; resumes on the same world size."""

    def _local_dir(self, info: CheckpointInfo) -> Path:
        """Where DeepSpeed writes (its tag's parent): the checkpoints' folder itself, or a
        node-local stage for S3 (named by that folder: the same for a save and its load)."""
        root = info.uri.rsplit("/", 1)[0]
        if not storage.is_s3(root):
            return Path(root)
        digest = hashlib.sha256(root.encode()).hexdigest()[:16]
        return Path(tempfile.gettempdir()) / "llm-pipeline-deepspeed" / digest

    def save(self, engine: Engine, info: CheckpointInfo, store: CheckpointStore,
             completed: Callable[[], None]) -> Future[None] | None:
        local_root, tag = self._local_dir(info), f"step-{info.step:08d}"
        engine.model.save_checkpoint(str(local_root), tag=tag, client_state={"trainer": info.trainer})  # type: ignore[operator]
        if storage.is_s3(info.uri):
            # each rank uploads the partitions it wrote; rank 0 also the shared model states
            rank = store.rank
            mine = re.compile(rf"zero_pp_rank_{rank}_|^mp_rank_" if rank == 0 else rf"zero_pp_rank_{rank}_")
            for path in sorted((local_root / tag).iterdir()):
                if mine.search(path.name):
                    storage.upload(path, storage.join(info.uri, path.name))
        if dist.is_initialized():
            dist.barrier()
        if store.rank == 0:
            storage.write_bytes(storage.join(info.uri, METADATA), json.dumps({"format": "deepspeed", "tag": tag}).encode())
        store.finish(info)
        return None

    def before_update(self) -> float:
        return 0.0

    def load(self, engine: Engine, info: CheckpointInfo, trainer: dict[str, Any]) -> dict[str, Any]:
        local_root, tag = self._local_dir(info), f"step-{info.step:08d}"
        if storage.is_s3(info.uri):
            for uri in storage.list_files(info.uri):
                storage.download(uri, local_root / tag / uri.rsplit("/", 1)[1])
        _, client_state = engine.model.load_checkpoint(str(local_root), tag=tag)  # type: ignore[operator]
        if client_state is None:
            raise RuntimeError(f"{info.uri}: DeepSpeed could not load this checkpoint")
        loaded: dict[str, Any] = client_state["trainer"]
        return loaded

    def close(self) -> None:
        pass


class Checkpointer:
    """What the trainer calls: save at its cadence, wait before an update, resume, and what
    each save cost the loop (``stalls``) and took until complete (``save_seconds``)."""

    def __init__(self, store: CheckpointStore, checkpoint_format: CheckpointFormat) -> None:
        self.store, self.format = store, checkpoint_format
        self._pending: Future[None] | None = None  # the background half of the last save
        self.blocking_seconds = 0.0  # time the training loop waited on checkpoints
        self.stalls: list[float] = []  # per save: seconds the loop waited
        self.save_seconds: list[float] = []  # per save: from its start until it was complete

    def save(self, engine: Engine, trainer: dict[str, Any]) -> None:
        self.before_update()  # (the loop has already waited for it)
        started = time.perf_counter()
        self.wait()  # one save in flight at a time
        pending = self.format.save(engine, self.store.info(trainer), self.store,
                                   lambda: self.save_seconds.append(time.perf_counter() - started))
        stall = time.perf_counter() - started
        self.stalls.append(stall)
        self.blocking_seconds += stall
        if pending is None:  # saved in the loop: complete when the stall ended
            self.save_seconds.append(stall)
            return
        self._pending = pending

    def before_update(self) -> None:
        """Before the optimizer changes the weights: the last save's copy of them must be done
        (only a background copy can still be running). Its wait counts as that save's stall."""
        waited = self.format.before_update()
        if waited:
            self.stalls[-1] += waited
            self.blocking_seconds += waited

    def wait(self) -> None:
        """Until the save in flight is complete; raises what it raised. (Its callers first wait
        for the background copy, before_update, which counts that wait as the save's stall.)"""
        if self._pending is not None:
            pending, self._pending = self._pending, None
            pending.result()

    def load(self, info: CheckpointInfo, engine: Engine, trainer: dict[str, Any]) -> dict[str, Any]:
        """The trainer state saved at ``info`` (``trainer`` gives its keys); the engine restored."""
        loaded = self.format.load(engine, info, trainer)
        log.info("resumed from %s (step %d, %d samples seen)", info.uri, loaded["step"], loaded["samples_seen"])
        return loaded

    def close(self) -> None:
        """At the end of training: the last save must be complete before the run ends, so the
        wait counts as blocking time."""
        self.before_update()
        started = time.perf_counter()
        self.wait()
        self.blocking_seconds += time.perf_counter() - started
        self.format.close()


def load_model_weights(uri: str, model: torch.nn.Module) -> None:
    """Load only the model part of a checkpoint into a plain (unsharded) model, no process group."""
    state = {"model": model.state_dict()}
    dcp.load(state, storage_reader=_reader(uri), planner=dcp.DefaultLoadPlanner(allow_partial_load=True))
    model.load_state_dict(state["model"])
