"""A decoder-only transformer in the Llama layout, free of any distribution code.

Pre-norm blocks (RMSNorm), rotary position embeddings (rotate-half, as Llama; scaled as
``linear`` or ``llama3`` where a checkpoint says so), causal ``scaled_dot_product_attention``
with grouped-query attention (``n_kv_heads`` key/value heads shared by the query heads), a
SwiGLU MLP, optional biases (Qwen2's q/k/v, Llama's ``attention_bias`` and ``mlp_bias``), and an
LM head tied to the token embedding or its own: the family Hugging Face's ``LlamaForCausalLM``,
``MistralForCausalLM`` and ``Qwen2ForCausalLM`` define (and so vLLM, TensorRT-LLM, llama.cpp,
ONNX Runtime GenAI's builder read); :mod:`tasks.lib.hf_checkpoint` reads and writes it.
Sized by the presets in params.yaml ``train.presets``; :mod:`tasks.train.engines` wraps it for
FSDP2 / DDP / DeepSpeed.

Saved models carry :data:`FORMAT_VERSION`. Format 1 (models trained before the Llama layout:
GELU MLP, rotary over interleaved channel pairs) is the ``gpt-v1`` layout of the same module,
so an old champion still loads, evaluates and serves; it has no Hugging Face form.

Two forwards: :meth:`GPT.forward` (training and evaluation: the whole window, causal) and
:meth:`GPT.forward_cached` (serving: new tokens after a per-sequence key/value cache).
"""

from __future__ import annotations

import math
from collections.abc import Collection
from dataclasses import asdict, dataclass
from typing import Any, cast

import torch
import torch.nn.functional as F
from torch import nn

# 1: the gpt-v1 layout (no format_version recorded); 2: Llama layout; 3: the Llama family's
# options (key/value heads, head size, biases, an untied head, rotary scaling). Each format's
# saved form is frozen in tests/tasks/saved_formats: changing what is saved means a new version,
# and GPTConfig.from_saved reading the previous ones
FORMAT_VERSION = 3
LAYOUTS = ("llama", "gpt-v1")
ROPE_SCALINGS = {"linear": ("factor",),
                 "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")}


@dataclass(frozen=True)
class GPTConfig:
    vocab_size: int
    seq_len: int
    d_model: int
    n_layers: int
    n_heads: int
    ffn_dim: int = 0  # hidden size of the MLP; 0: Llama's 8/3 * d_model, rounded up to a multiple of 32
    rope_theta: float = 10000.0
    norm_eps: float | None = 1e-5  # None: torch's default (the dtype's epsilon), as gpt-v1 trained
    layout: str = "llama"
    n_kv_heads: int = 0  # key/value heads (grouped-query attention); 0: n_heads
    head_size: int = 0  # channels per head; 0: d_model / n_heads
    tie_embeddings: bool = True  # the LM head is the token embedding
    qkv_bias: bool = False  # biases on q, k, v (Qwen2; Llama's attention_bias)
    out_bias: bool = False  # a bias on the attention's output projection (Llama's attention_bias)
    mlp_bias: bool = False
    rope_scaling: dict[str, Any] | None = None  # {"rope_type": "linear" | "llama3", its factors}

    def __post_init__(self) -> None:
        if self.layout not in LAYOUTS:
            raise ValueError(f"layout {self.layout!r}: expected one of {', '.join(LAYOUTS)}")
        if not self.head_size and self.d_model % self.n_heads:
            raise ValueError(f"d_model {self.d_model} is not divisible by n_heads {self.n_heads}")
        object.__setattr__(self, "head_size", self.head_size or self.d_model // self.n_heads)
        object.__setattr__(self, "n_kv_heads", self.n_kv_heads or self.n_heads)
        if self.head_size % 2:
            raise ValueError(f"head size {self.head_size} must be even for rotary embeddings")
        if self.n_heads % self.n_kv_heads:
            raise ValueError(f"n_heads {self.n_heads} is not a multiple of n_kv_heads {self.n_kv_heads}")
        if self.rope_scaling is not None:
            kind = self.rope_scaling.get("rope_type")
            if kind not in ROPE_SCALINGS:
                raise ValueError(f"rope_scaling: rope_type {kind!r} is not supported (expected one of "
                                 f"{', '.join(ROPE_SCALINGS)})")
            missing = [k for k in ROPE_SCALINGS[kind] if not isinstance(self.rope_scaling.get(k), int | float)]
            if missing:
                raise ValueError(f"rope_scaling: {kind} needs a number for {', '.join(missing)}")
        if self.layout == "gpt-v1" and (self.n_kv_heads != self.n_heads or not self.tie_embeddings or self.qkv_bias
                                        or self.out_bias or self.mlp_bias or self.rope_scaling):
            raise ValueError("layout gpt-v1 has none of the Llama family's options")
        if not self.ffn_dim:
            object.__setattr__(self, "ffn_dim", 32 * math.ceil(8 * self.d_model / 3 / 32))

    @property
    def head_dim(self) -> int:
        return self.head_size

    @property
    def q_dim(self) -> int:
        return self.n_heads * self.head_size

    @property
    def kv_dim(self) -> int:
        return self.n_kv_heads * self.head_size

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_saved(cls, saved: dict[str, Any], format_version: int) -> GPTConfig:
        """The configuration a saved model recorded, in any format this code reads."""
        if format_version == 1:
            legacy = dict(saved)
            ratio = int(legacy.pop("mlp_ratio", 4))
            return cls(**legacy, ffn_dim=ratio * int(legacy["d_model"]), norm_eps=None, layout="gpt-v1")
        if format_version in (2, FORMAT_VERSION):  # format 2: the Llama family's options at their defaults
            return cls(**saved)
        raise ValueError(f"model format {format_version}: this code reads formats 1..{FORMAT_VERSION}")

    def num_params(self) -> int:
        """Parameters (a tied LM head counted once)."""
        mlp = (2 if self.layout == "gpt-v1" else 3) * self.d_model * self.ffn_dim
        mlp += (2 * self.ffn_dim + self.d_model) * self.mlp_bias
        attention = self.d_model * (self.q_dim + 2 * self.kv_dim) + self.q_dim * self.d_model
        attention += (self.q_dim + 2 * self.kv_dim) * self.qkv_bias + self.d_model * self.out_bias
        per_block = attention + mlp + 2 * self.d_model
        head = 0 if self.tie_embeddings else self.vocab_size * self.d_model
        return self.vocab_size * self.d_model + head + self.n_layers * per_block + self.d_model

    def flops_per_token(self) -> int:
        """Forward + backward matmul FLOPs per token (6N + attention)."""
        return 6 * self.num_params() + 12 * self.n_layers * self.d_model * self.seq_len


def rope_frequencies(config: GPTConfig, device: torch.device | None = None) -> torch.Tensor:
    """Each channel pair's rotary frequency (head_dim / 2,), scaled as ``config.rope_scaling``
    says: ``linear`` divides every frequency by the factor; ``llama3`` divides the low ones (long
    wavelengths) and blends the middle band (transformers' ``_compute_llama3_parameters``)."""
    inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, config.head_dim, 2, device=device).float() / config.head_dim))
    scaling = config.rope_scaling
    if scaling is None:
        return inv_freq
    factor = float(scaling["factor"])
    if scaling["rope_type"] == "linear":
        return inv_freq / factor
    low, high = float(scaling["low_freq_factor"]), float(scaling["high_freq_factor"])
    old_context = float(scaling["original_max_position_embeddings"])
    wavelength = 2 * math.pi / inv_freq
    scaled = torch.where(wavelength > old_context / low, inv_freq / factor, inv_freq)
    smooth = (old_context / wavelength - low) / (high - low)
    blended = (1 - smooth) * scaled / factor + smooth * scaled
    middle = (wavelength >= old_context / high) & (wavelength <= old_context / low)
    return torch.where(middle, blended, scaled)


def rope_tables(config: GPTConfig, device: torch.device | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of each position's angles (seq_len, head_dim / 2)."""
    angles = torch.outer(torch.arange(config.seq_len, device=device).float(), rope_frequencies(config, device))
    return angles.cos(), angles.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool = False) -> torch.Tensor:
    """Rotate ``x`` (batch, heads, time, head_dim) by position; ``cos``/``sin`` are (time, head_dim/2)
    or per sequence (batch, 1, time, head_dim/2). Llama rotates the first half of the channels
    against the second (rotate-half); gpt-v1 rotated interleaved pairs."""
    cos, sin = cos.to(x.dtype), sin.to(x.dtype)
    if interleaved:
        x1, x2 = x[..., 0::2], x[..., 1::2]
        return torch.stack((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1).flatten(-2)
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


class Attention(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_size = config.n_heads, config.n_kv_heads, config.head_size
        self.interleaved = config.layout == "gpt-v1"
        # q, k, v rows in that order: n_heads query heads, then n_kv_heads key and value heads
        self.qkv = nn.Linear(config.d_model, config.q_dim + 2 * config.kv_dim, bias=config.qkv_bias)
        self.proj = nn.Linear(config.q_dim, config.d_model, bias=config.out_bias)

    def heads(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """q (batch, heads, time, head_dim), k and v (batch, kv_heads, time, head_dim); q and k rotated."""
        b, t, _ = x.shape
        q, k, v = self.qkv(x).split((self.n_heads * self.head_size, self.n_kv_heads * self.head_size,
                                     self.n_kv_heads * self.head_size), dim=-1)
        q = q.view(b, t, self.n_heads, self.head_size).transpose(1, 2)
        k = k.view(b, t, self.n_kv_heads, self.head_size).transpose(1, 2)
        v = v.view(b, t, self.n_kv_heads, self.head_size).transpose(1, 2)
        return apply_rope(q, cos, sin, self.interleaved), apply_rope(k, cos, sin, self.interleaved), v

    def shared(self, kv: torch.Tensor) -> torch.Tensor:
        """Each key/value head repeated for the query heads of its group (as transformers' ``repeat_kv``)."""
        groups = self.n_heads // self.n_kv_heads
        return kv if groups == 1 else kv.repeat_interleave(groups, dim=1)

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        k, v = self.shared(k), self.shared(v)
        if mask is None:
            return F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)

    def merge(self, out: torch.Tensor) -> torch.Tensor:
        b, _, t, _ = out.shape
        return self.proj(out.transpose(1, 2).reshape(b, t, -1))  # type: ignore[no-any-return]

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        t = x.shape[1]
        q, k, v = self.heads(x, cos[:t], sin[:t])
        return self.merge(self.attend(q, k, v))


class SwiGLU(nn.Module):
    """Llama's MLP: down(silu(gate(x)) * up(x)); gate and up are one matmul (rows: gate, then up)."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.gate_up = nn.Linear(config.d_model, 2 * config.ffn_dim, bias=config.mlp_bias)
        self.down = nn.Linear(config.ffn_dim, config.d_model, bias=config.mlp_bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up(x).chunk(2, dim=-1)
        return self.down(F.silu(gate) * up)  # type: ignore[no-any-return]


class GeluMLP(nn.Module):
    """gpt-v1's MLP (format 1 models only)."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.up = nn.Linear(config.d_model, config.ffn_dim, bias=False)
        self.down = nn.Linear(config.ffn_dim, config.d_model, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(F.gelu(self.up(x), approximate="tanh"))  # type: ignore[no-any-return]


MLP = GeluMLP  # the name gpt-v1's pickled registry models refer to


class Block(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.norm1 = nn.RMSNorm(config.d_model, eps=config.norm_eps)
        self.attn = Attention(config)
        self.norm2 = nn.RMSNorm(config.d_model, eps=config.norm_eps)
        self.mlp = GeluMLP(config) if config.layout == "gpt-v1" else SwiGLU(config)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x), cos, sin)
        return x + self.mlp(self.norm2(x))  # type: ignore[no-any-return]

    def forward_cached(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, past_k: torch.Tensor,
                       past_v: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``x`` (batch, new, d) after ``past_k``/``past_v`` (batch, kv_heads, past, head_dim);
        ``mask`` (batch, 1, new, past + new) says which keys each new token sees. Returns the
        block's output and the new tokens' keys and values (the cache holds the key/value heads
        only: grouped-query attention's saving)."""
        q, k, v = self.attn.heads(self.norm1(x), cos, sin)
        keys, values = torch.cat((past_k, k), dim=2), torch.cat((past_v, v), dim=2)
        x = x + self.attn.merge(self.attn.attend(q, keys, values, mask))
        return x + self.mlp(self.norm2(x)), k, v


class GPT(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.config = config
        self.embed = nn.Embedding(config.vocab_size, config.d_model)
        self.blocks = nn.ModuleList(Block(config) for _ in range(config.n_layers))
        self.norm = nn.RMSNorm(config.d_model, eps=config.norm_eps)
        self.head = nn.Linear(config.d_model, config.vocab_size, bias=False)
        if config.tie_embeddings:
            self.head.weight = self.embed.weight  # the state dict's second name of it: TIED_HEAD
        cos, sin = rope_tables(config)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)
        self.activation_checkpointing = False
        self.reset_parameters()

    TIED_HEAD = "head.weight"

    @classmethod
    def second_names(cls, config: GPTConfig) -> set[str]:
        """State-dict names that are a second name of another's parameter (stored once)."""
        return {cls.TIED_HEAD} if config.tie_embeddings else set()

    def reset_parameters(self) -> None:
        # GPT-2 initialisation; residual projections scaled by depth
        for name, param in self.named_parameters():
            if name.endswith(".bias"):
                nn.init.zeros_(param)
            if param.dim() < 2:
                continue
            std = 0.02 / math.sqrt(2 * self.config.n_layers) if name.endswith(("proj.weight", "down.weight")) else 0.02
            nn.init.normal_(param, mean=0.0, std=std)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        """Logits (batch, time, vocab) for token ids (batch, time)."""
        if idx.shape[1] > self.config.seq_len:
            raise ValueError(f"sequence of {idx.shape[1]} tokens exceeds seq_len {self.config.seq_len}")
        x = self.embed(idx)
        for block in self.blocks:
            if self.activation_checkpointing and self.training:
                x = torch.utils.checkpoint.checkpoint(block, x, self.rope_cos, self.rope_sin, use_reentrant=False)
            else:
                x = block(x, self.rope_cos, self.rope_sin)
        logits: torch.Tensor = self.head(self.norm(x))
        return logits

    def forward_cached(self, input_ids: torch.Tensor, past_keys: torch.Tensor, past_values: torch.Tensor,
                       past_lengths: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Serving: the next-token logits (batch, vocab) after ``input_ids`` (batch, new), each
        sequence continuing its cache. ``past_keys``/``past_values`` (layers, batch, kv_heads, past,
        head_dim) hold each sequence's first ``past_lengths[b]`` positions (the rest is padding,
        masked out; a prefill passes a past of one masked slot). Returns the logits and the new
        tokens' keys and values (layers, batch, kv_heads, new, head_dim), to append to the cache.
        Positions past ``seq_len`` have no rotary angles: callers keep within the context."""
        new, past = input_ids.shape[1], past_keys.shape[3]
        steps = torch.arange(new, device=input_ids.device)
        positions = past_lengths[:, None] + steps  # (batch, new)
        cos_table, sin_table = cast(torch.Tensor, self.rope_cos), cast(torch.Tensor, self.rope_sin)
        cos, sin = cos_table[positions].unsqueeze(1), sin_table[positions].unsqueeze(1)
        seen_past = torch.arange(past, device=input_ids.device)[None, :] < past_lengths[:, None]  # (batch, past)
        causal = steps[None, :] <= steps[:, None]  # (new, new)
        mask = torch.cat((seen_past[:, None, :].expand(-1, new, -1),
                          causal[None].expand(input_ids.shape[0], -1, -1)), dim=2).unsqueeze(1)
        x = self.embed(input_ids)
        keys, values = [], []
        for layer, block in enumerate(self.blocks):
            x, k, v = cast(Block, block).forward_cached(x, cos, sin, past_keys[layer], past_values[layer], mask)
            keys.append(k)
            values.append(v)
        logits: torch.Tensor = self.head(self.norm(x[:, -1])).float()
        return logits, torch.stack(keys), torch.stack(values)

    def loss(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        logits = self(idx)
        return F.cross_entropy(logits.float().view(-1, logits.size(-1)), targets.reshape(-1))


def empty_cache(config: GPTConfig, batch: int, length: int = 1,
                dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    """Zero keys and values (layers, batch, kv_heads, length, head_dim): a prefill's masked past."""
    shape = (config.n_layers, batch, config.n_kv_heads, length, config.head_dim)
    return torch.zeros(shape, dtype=dtype), torch.zeros(shape, dtype=dtype)


@torch.no_grad()
def generate_greedy(model: GPT, prompt: list[int], max_new: int, eos_ids: Collection[int] = ()) -> list[int]:
    """The reference continuation (greedy, KV cache, batch 1): what every served engine must
    reproduce token for token. Stops at any of ``eos_ids`` (not returned) or the context's end."""
    limit = min(max_new, model.config.seq_len - len(prompt))
    past_k, past_v = empty_cache(model.config, 1)
    length = torch.zeros(1, dtype=torch.long)
    ids = torch.tensor([prompt], dtype=torch.long)
    out: list[int] = []
    for _ in range(max(0, limit)):
        logits, k, v = model.forward_cached(ids, past_k, past_v, length)
        if out or length.item():
            past_k, past_v = torch.cat((past_k, k), dim=3), torch.cat((past_v, v), dim=3)
        else:  # after the prefill the masked placeholder slot goes
            past_k, past_v = k, v
        length = torch.tensor([past_k.shape[3]], dtype=torch.long)
        token = int(logits.argmax(dim=-1))
        if token in eos_ids:
            break
        out.append(token)
        ids = torch.tensor([[token]], dtype=torch.long)
    return out
