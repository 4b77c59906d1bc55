"""What a served version takes in Triton's memory, counted before it is loaded, and the check
that a deploy stays within ``serve.memory_budget_mb``.

A version is two Triton models: the logits model and the generation engine. Each runs an ONNX
Runtime session that holds its graph's weights (``model.onnx``, ``decoder.onnx`` and any external
data), and the engine preallocates its key/value cache for as many whole-context sequences as
its configuration's ``kv_cache_bytes`` holds, at most ``max_slots``
(:meth:`EngineLimits.slots_for`). Counted: every file of the version's two folders (the ONNX
files dominate; tokenizer and code are small) but one of the engine's two decoders (it loads
``decoder_fused.onnx`` on a CPU, ``decoder.onnx`` on a GPU), and that cache. Not counted: ONNX Runtime's
working buffers of a step (a batch's activations), Triton's and Python's own size, and on a GPU
the second session of ``decoder.onnx`` whose decode step is a CUDA graph
(``serve.generate.cuda_graph``: the decoder's weights once more; deploy does not know the
device a Triton runs on): leave room for them in the budget.

Locally one Triton holds stable and the canary at once (their sum is checked, before anything is
staged); in a cluster each track's pod holds one version, which its init container checks (the
pod then fails to start, and the deploy's wait for the track's rollout fails with it). A
rollback warns instead of refusing: it must not be stopped in an emergency.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from tasks.config import ServeSettings
from tasks.lib.errors import StepError
from tasks.lib.step import log
from tasks.serving.triton_models.llm_generate.engine import CacheShape, EngineLimits, FusedKVDecoder

MIB = 2**20


@dataclass(frozen=True)
class Footprint:
    """One version's memory in Triton, as counted before loading it."""

    version: int
    weights_bytes: int  # the files of both models' version folders
    slots: int  # the engine's KV cache, in whole-context sequences
    cache_bytes: int
    line: str = ""  # another model line's version (one Triton serves them all): its name

    @property
    def total_bytes(self) -> int:
        return self.weights_bytes + self.cache_bytes

    def describe(self) -> str:
        of = f"line {self.line}'s " if self.line else ""
        return (f"{of}version {self.version} {self.total_bytes / MIB:,.0f} MiB ({self.weights_bytes / MIB:,.0f} MiB of "
                f"weights, {self.slots} KV cache slots {self.cache_bytes / MIB:,.0f} MiB)")


def folder_bytes(folder: Path) -> int:
    return sum(f.stat().st_size for f in folder.rglob("*") if f.is_file())


def footprint(models: Path, serve: ServeSettings, version: int, engine_config: Path) -> Footprint:
    """``version``'s footprint from a model repository or an export's ``triton/`` folder
    (``models``), its engine sized by ``engine_config`` (the configuration it loads with); the
    logits model once per instance (``serve.instances``: a session each)."""
    folders = [models / name / str(version) for name in (serve.triton_model, serve.generate_model)]
    weights = serve.instances * folder_bytes(folders[0]) + folder_bytes(folders[1])
    decoders = [folders[1] / name for name in ("decoder.onnx", FusedKVDecoder.FILE)]
    if all(path.exists() for path in decoders):  # one is loaded: the larger counted
        weights -= min(path.stat().st_size for path in decoders)
    shape = CacheShape.of_generation(json.loads((folders[1] / "generation.json").read_text()))
    try:
        slots = EngineLimits.of_config(json.loads(engine_config.read_text())).slots_for(shape)
    except ValueError as exc:  # the engine would refuse to load: say so before anything moves
        raise StepError(f"version {version}: {exc}") from None
    return Footprint(version, weights, slots, slots * shape.slot_bytes)


def check_budget(incoming: Footprint, beside: Iterable[Footprint], serve: ServeSettings, enforce: bool = True) -> None:
    """:class:`StepError` (one line) when ``incoming`` and the versions it would be served beside
    exceed ``serve.memory_budget_mb`` (0: not checked); not ``enforce`` (a rollback, which must
    not be refused in an emergency): a warning."""
    if not serve.memory_budget_mb:
        return
    held = [incoming, *beside]
    total = sum(f.total_bytes for f in held)
    if total > serve.memory_budget_mb * MIB:
        others = f" beside {', '.join(f.describe() for f in held[1:])}" if held[1:] else ""
        line = (f"{incoming.describe()}{others}: {total / MIB:,.0f} MiB, over serve.memory_budget_mb "
                f"{serve.memory_budget_mb:g} (lower serve.kv_cache_mb or serve.max_slots, or raise the budget)")
        if not enforce:
            log.warning("%s: loading it anyway (a rollback)", line)
            return
        raise StepError(line)
