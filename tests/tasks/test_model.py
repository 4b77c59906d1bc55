"""The GPT and the training data sampler (unit)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from helpers import write_dataset

from tasks.lib.data import BatchSampler, open_split
from tasks.lib.errors import StepError
from tasks.lib.model import FORMAT_VERSION, GPT, GPTConfig, apply_rope, empty_cache, generate_greedy

TINY = GPTConfig(vocab_size=97, seq_len=16, d_model=32, n_layers=2, n_heads=4)
LEGACY = GPTConfig(vocab_size=97, seq_len=16, d_model=32, n_layers=2, n_heads=4, ffn_dim=128, norm_eps=None,
                   layout="gpt-v1")
LEGACY_SAVED = ("vocab_size", "seq_len", "d_model", "n_layers", "n_heads", "rope_theta")


@pytest.mark.parametrize("config", [TINY, LEGACY], ids=["llama", "gpt-v1"])
def test_forward_shapes_and_tied_head(config: GPTConfig) -> None:
    model = GPT(config)
    logits = model(torch.randint(0, 97, (3, 16)))
    assert logits.shape == (3, 16, 97)
    assert model.head.weight is model.embed.weight
    assert sum(p.numel() for p in model.parameters()) == config.num_params()


def test_llama_layout_swiglu_and_rotate_half() -> None:
    model = GPT(TINY)
    assert TINY.ffn_dim == 96  # 8/3 * 32 rounded up to a multiple of 32
    assert model.blocks[0].mlp.gate_up.weight.shape == (2 * 96, 32)
    assert not any(name.endswith("bias") for name, _ in model.named_parameters())
    x = torch.randn(1, 1, 3, 4)
    cos, sin = torch.zeros(3, 2), torch.ones(3, 2)  # a quarter turn: (x1, x2) -> (-x2, x1) on the halves
    rotated = apply_rope(x, cos, sin)
    assert torch.equal(rotated, torch.cat((-x[..., 2:], x[..., :2]), dim=-1))


@pytest.mark.parametrize("config", [TINY, LEGACY], ids=["llama", "gpt-v1"])
def test_cached_forward_equals_the_full_window(config: GPTConfig) -> None:
    """Prefill then one token at a time, two sequences of different lengths in one batch (the
    shorter one's cache padded and masked), against the whole window in one forward."""
    torch.manual_seed(0)
    model = GPT(config).eval()
    ids = torch.randint(0, 97, (2, 16))
    with torch.no_grad():
        full = model(ids)
        caches = []
        for row, length in ((0, 5), (1, 9)):
            logits, k, v = model.forward_cached(ids[row:row + 1, :length], *empty_cache(config, 1), torch.zeros(1, dtype=torch.long))
            assert torch.allclose(logits[0], full[row, length - 1], atol=1e-5)
            caches.append((k, v))
        keys, values = empty_cache(config, 2, 9)
        keys[:, 0, :, :5], values[:, 0, :, :5] = caches[0][0][:, 0], caches[0][1][:, 0]
        keys[:, 1], values[:, 1] = caches[1][0][:, 0], caches[1][1][:, 0]
        lengths = torch.tensor([5, 9])
        for _ in range(6):
            logits, k, v = model.forward_cached(ids[[0, 1], lengths].view(2, 1), keys, values, lengths)
            assert torch.allclose(logits, full[[0, 1], lengths], atol=1e-5)
            keys, values = torch.cat((keys, torch.zeros_like(k)), 3), torch.cat((values, torch.zeros_like(v)), 3)
            for row in range(2):
                keys[:, row, :, lengths[row]], values[:, row, :, lengths[row]] = k[:, row, :, 0], v[:, row, :, 0]
            lengths = lengths + 1


def test_greedy_generation_with_the_cache_equals_recomputing_the_window() -> None:
    torch.manual_seed(1)
    model = GPT(TINY).eval()
    prompt = [5, 17, 3]
    window = list(prompt)
    with torch.no_grad():
        for _ in range(10):
            window.append(int(model(torch.tensor([window]))[0, -1].argmax()))
    assert generate_greedy(model, prompt, 10) == window[3:]
    assert len(generate_greedy(model, prompt, 100)) == 16 - 3  # never past the context


def test_saved_format_1_loads_as_gpt_v1() -> None:
    saved = {"vocab_size": 97, "seq_len": 16, "d_model": 32, "n_layers": 2, "n_heads": 4, "mlp_ratio": 4,
             "rope_theta": 10000.0}
    assert GPTConfig.from_saved(saved, 1) == LEGACY
    assert GPTConfig.from_saved(TINY.to_dict(), FORMAT_VERSION) == TINY
    with pytest.raises(ValueError, match=f"model format {FORMAT_VERSION + 1}"):
        GPTConfig.from_saved(TINY.to_dict(), FORMAT_VERSION + 1)


@pytest.mark.parametrize("config", [TINY, LEGACY], ids=["llama", "gpt-v1"])
def test_saved_model_files_round_trip_and_refuse_what_does_not_fit(config: GPTConfig, tmp_path: Path) -> None:
    """model.safetensors + config.json: the tied head stored once, the same logits back; weights
    of another architecture or a corrupt file are one line, not a traceback."""
    from safetensors import safe_open

    from tasks.lib.model_store import load_model_files, save_model_files

    model = GPT(config).eval()
    description: dict[str, object] = {"format_version": FORMAT_VERSION, "config": config.to_dict()}
    if config.layout == "gpt-v1":  # as older code described it: no format version, mlp_ratio
        description = {"config": {**{k: v for k, v in config.to_dict().items() if k in LEGACY_SAVED}, "mlp_ratio": 4}}
    save_model_files(model.state_dict(), description, tmp_path)
    with safe_open(str(tmp_path / "model.safetensors"), "pt") as stored:
        names = set(stored.keys())
    assert "embed.weight" in names and "head.weight" not in names
    loaded = load_model_files(tmp_path / "config.json", tmp_path / "model.safetensors", "folder").model
    ids = torch.randint(0, 97, (2, 16))
    assert torch.equal(loaded(ids), model(ids))

    wider = {**description, "config": {**description["config"], "d_model": 64}}  # type: ignore[dict-item]
    (tmp_path / "config.json").write_text(json.dumps(wider))
    with pytest.raises(StepError, match=r"^folder: its weights do not load into the architecture it describes"):
        load_model_files(tmp_path / "config.json", tmp_path / "model.safetensors", "folder")
    (tmp_path / "model.safetensors").write_bytes(b"\x00" * 16)
    with pytest.raises(StepError, match=r"^folder: its weights do not load"):
        load_model_files(tmp_path / "config.json", tmp_path / "model.safetensors", "folder")


@pytest.mark.parametrize("tied", [True, False], ids=["tied", "untied"])
def test_the_second_names_are_the_state_dicts_names_no_parameter_goes_by(tied: bool) -> None:
    """GPT.second_names (what save_model_files leaves out) agrees with the module itself."""
    model = GPT(GPTConfig(vocab_size=97, seq_len=16, d_model=32, n_layers=1, n_heads=2, tie_embeddings=tied))
    by_module = set(model.state_dict()) - {n for n, _ in model.named_parameters()}
    assert GPT.second_names(model.config) == by_module == ({"head.weight"} if tied else set())


class RunsCodeWhenUnpickled:
    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[object, ...]:
        return (Path.touch, (self.marker,))


def test_a_pickled_gpt_of_older_code_loads_and_no_other_pickle_runs(tmp_path: Path) -> None:
    """What older code registered (a whole GPT pickled, its MLP class then named ``MLP``) loads
    as weights; a pickle that names a function to call, or holds no module, is one line, and
    nothing it names runs."""
    import zipfile

    from tasks.lib.model import GeluMLP
    from tasks.lib.model_store import load_pickled_gpt

    model = GPT(LEGACY).eval()
    GeluMLP.__qualname__ = "MLP"  # gpt-v1's code's name for it
    try:
        torch.save(model, tmp_path / "model.pth")
    finally:
        GeluMLP.__qualname__ = "GeluMLP"
    with zipfile.ZipFile(tmp_path / "model.pth") as saved:
        pickled = saved.read(next(n for n in saved.namelist() if n.endswith("data.pkl")))
    assert b"\nMLP\n" in pickled and b"GeluMLP" not in pickled
    description = {"config": {**{k: v for k, v in LEGACY.to_dict().items() if k in LEGACY_SAVED}, "mlp_ratio": 4}}
    loaded = load_pickled_gpt(tmp_path / "model.pth", description, "v1").model
    ids = torch.randint(0, 97, (2, 16))
    assert torch.equal(loaded(ids), model(ids))

    marker = tmp_path / "it-ran"
    torch.save(RunsCodeWhenUnpickled(marker), tmp_path / "evil.pth")
    with pytest.raises(StepError, match=r"^v2: its pickled module \(evil.pth\) is refused: it names .*nothing in it was run$"):
        load_pickled_gpt(tmp_path / "evil.pth", description, "v2")
    assert not marker.exists()
    torch.save({"embed.weight": torch.zeros(1)}, tmp_path / "dict.pth")
    with pytest.raises(StepError, match=r"^v3: its pickle holds a dict, not this project's GPT$"):
        load_pickled_gpt(tmp_path / "dict.pth", description, "v3")


def test_attention_is_causal() -> None:
    torch.manual_seed(0)
    model = GPT(TINY).eval()
    ids = torch.randint(0, 97, (1, 16))
    changed = ids.clone()
    changed[0, 10:] = (changed[0, 10:] + 1) % 97
    with torch.no_grad():
        a, b = model(ids), model(changed)
    assert torch.allclose(a[0, :10], b[0, :10], atol=1e-6)
    assert not torch.allclose(a[0, 10:], b[0, 10:])


def test_loss_starts_near_uniform_and_a_step_lowers_it() -> None:
    torch.manual_seed(0)
    model = GPT(TINY)
    x = torch.randint(0, 97, (4, 16))
    loss = model.loss(x[:, :-1], x[:, 1:])
    assert abs(loss.item() - np.log(97)) < 0.3
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for _ in range(5):
        opt.zero_grad()
        model.loss(x[:, :-1], x[:, 1:]).backward()
        opt.step()
    assert model.loss(x[:, :-1], x[:, 1:]).item() < loss.item() - 0.5


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"n_heads": 5}, "not divisible"), ({"n_heads": 32}, "must be even"),
    ({"n_kv_heads": 3}, "n_heads 4 is not a multiple of n_kv_heads 3"),
    ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "rope_type 'yarn' is not supported"),
    ({"rope_scaling": {"rope_type": "llama3", "factor": 8.0}}, "llama3 needs a number for low_freq_factor"),
    ({"layout": "gpt-v1", "qkv_bias": True}, "gpt-v1 has none of the Llama family's options")])
def test_bad_configs_are_rejected(kwargs: dict[str, Any], message: str) -> None:
    derived = {"head_size", "n_kv_heads"}  # (what to_dict records once the config worked them out)
    with pytest.raises(ValueError, match=message):
        GPTConfig(**{**{k: v for k, v in TINY.to_dict().items() if k not in derived}, **kwargs})


def test_longer_input_than_seq_len_is_an_error() -> None:
    with pytest.raises(ValueError, match="exceeds seq_len"):
        GPT(TINY)(torch.zeros(1, 17, dtype=torch.long))


def stream(n: int) -> np.memmap:  # type: ignore[type-arg]
    return np.arange(n, dtype=np.uint16)  # type: ignore[return-value]


def test_global_sample_sequence_is_independent_of_world_size() -> None:
    sampler = BatchSampler(stream(10_000), seq_len=16, micro_batch=2, seed=7)
    one = [sampler.batch(seen, 0, 1)[0] for seen in range(0, 40, 2)]
    two = [torch.cat([sampler.batch(seen, r, 2)[0] for r in range(2)]) for seen in range(0, 40, 4)]
    assert torch.equal(torch.cat(one), torch.cat(two))


def test_batches_are_windows_with_shifted_targets_and_epochs_reshuffle() -> None:
    sampler = BatchSampler(stream(16 * 5 + 1), seq_len=16, micro_batch=1, seed=3)
    assert sampler.windows == 5
    x, y = sampler.batch(0, 0, 1)
    assert torch.equal(x[0, 1:], y[0, :-1]) and x[0, 0] % 16 == 0
    first = [int(sampler.batch(g, 0, 1)[0][0, 0]) for g in range(5)]
    second = [int(sampler.batch(g, 0, 1)[0][0, 0]) for g in range(5, 10)]
    assert sorted(first) == sorted(second) == [0, 16, 32, 48, 64] and first != second


def test_open_split_checks_files_against_the_index(tmp_path: Path) -> None:
    good = write_dataset(tmp_path / "good", np.arange(100, dtype=np.uint16), 128)
    assert len(open_split(good, "train").tokens) == 100
    with pytest.raises(StepError, match=r"no index\.json"):
        open_split(tmp_path / "nothing", "train")
    with pytest.raises(StepError, match=r"index\.json says 90 uint16 tokens"):
        open_split(write_dataset(tmp_path / "short", np.arange(100, dtype=np.uint16), 128, claimed=90), "train")
    with pytest.raises(StepError, match="empty"):
        open_split(write_dataset(tmp_path / "empty", np.arange(0, dtype=np.uint16), 128), "train")


def test_activation_checkpointing_gives_the_same_loss_and_gradients() -> None:
    torch.manual_seed(0)
    plain = GPT(TINY)
    recomputed = GPT(TINY)
    recomputed.load_state_dict(plain.state_dict())
    recomputed.activation_checkpointing = True
    x = torch.randint(0, 97, (2, 16))
    losses = []
    for model in (plain, recomputed):
        loss = model.loss(x[:, :-1], x[:, 1:])
        loss.backward()
        losses.append(loss.item())
    assert losses[0] == pytest.approx(losses[1], abs=1e-6)
    for (name, a), (_, b) in zip(plain.named_parameters(), recomputed.named_parameters(), strict=True):
        assert torch.allclose(a.grad, b.grad, atol=1e-6), name


SAVED_FORMATS = Path(__file__).parent / "saved_formats"


def saved_format(version: int) -> dict[str, Any]:
    loaded: dict[str, Any] = json.loads((SAVED_FORMATS / f"format-{version}.json").read_text())
    return loaded


@pytest.mark.parametrize("version", range(1, FORMAT_VERSION + 1))
def test_a_model_saved_in_each_known_format_still_loads(version: int, tmp_path: Path) -> None:
    """Frozen on-disk forms (tests/tasks/saved_formats: config.json as saved, the stored tensors'
    names and shapes): next month's code must load this month's champion."""
    from safetensors.torch import save_file

    from tasks.lib.model_store import load_model_files

    frozen = saved_format(version)
    generator = torch.Generator().manual_seed(version)
    save_file({name: torch.randn(shape, generator=generator) for name, shape in frozen["tensors"].items()},
              str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text(json.dumps(frozen["description"]))
    model = load_model_files(tmp_path / "config.json", tmp_path / "model.safetensors", f"format {version}").model
    vocab, context = frozen["description"]["config"]["vocab_size"], frozen["description"]["config"]["seq_len"]
    logits = model(torch.randint(0, vocab, (2, context)))
    assert logits.shape == (2, context, vocab) and bool(torch.isfinite(logits).all())


def test_todays_saved_form_is_the_newest_frozen_format(tmp_path: Path) -> None:
    """What today's code saves is exactly the newest frozen format: a renamed field or tensor
    fails here until FORMAT_VERSION is bumped, GPTConfig.from_saved reads the previous format,
    and tests/tasks/saved_formats/format-<new>.json freezes the new one."""
    from safetensors import safe_open

    from tasks.lib.model_store import save_model_files

    frozen = saved_format(FORMAT_VERSION)
    config = GPTConfig(**frozen["description"]["config"])
    save_model_files(GPT(config).state_dict(), frozen["description"], tmp_path)
    with safe_open(str(tmp_path / "model.safetensors"), "pt") as stored:
        tensors = {name: list(stored.get_slice(name).get_shape()) for name in stored.keys()}  # noqa: SIM118 (safe_open is not iterable)
    changed = "the saved format changed: bump FORMAT_VERSION, read the old one in GPTConfig.from_saved, freeze the new"
    assert tensors == frozen["tensors"], changed
    assert config.to_dict() == frozen["description"]["config"], changed
    assert not (SAVED_FORMATS / f"format-{FORMAT_VERSION + 1}.json").exists()
