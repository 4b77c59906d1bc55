"""The ``train`` section: the model presets, the engine and the optimizer."""

from __future__ import annotations

import dataclasses
from typing import Literal, Union

from tasks.config.base import at_least_zero, check, fractions, positive

Engine = Literal["fsdp2", "ddp", "deepspeed", "single"]
Precision = Literal["auto", "bf16", "fp32"]
InitFrom = Literal["champion", "scratch"]
Switch = Union[bool, Literal["auto"]]  # noqa: UP007 (typing.get_type_hints needs a runtime object)


@dataclasses.dataclass(frozen=True)
class Preset:
    seq_len: int
    """Context length in tokens."""
    d_model: int
    """Width of the residual stream."""
    n_layers: int
    """Transformer blocks."""
    n_heads: int
    """Attention heads (d_model / n_heads must be even: rotary embeddings)."""
    ffn_dim: int = 0
    """Hidden size of the SwiGLU MLP; 0: 8/3 d_model rounded up to a multiple of 32."""
    rope_theta: float = 10000.0
    """Rotary embeddings' base."""

    def __post_init__(self) -> None:
        positive(self, "seq_len", "d_model", "n_layers", "n_heads")
        check(self.d_model % self.n_heads == 0, "d_model", self.d_model, f"not divisible by n_heads {self.n_heads}")


@dataclasses.dataclass(frozen=True)
class TrainSettings:
    preset: str
    """The model size: one of ``presets``."""
    engine: Engine
    """fsdp2 | ddp | deepspeed | single."""
    deepspeed_stage: Literal[2, 3]
    """ZeRO stage of the deepspeed engine."""
    nodes: int
    """torchrun nodes (local: processes on 127.0.0.1; cluster: Indexed Job pods)."""
    procs_per_node: int
    """Processes (GPUs) per node."""
    max_restarts: int
    """torchrun restarts of a failed worker group before the step fails."""
    precision: Precision
    """bf16 autocast or fp32; auto: bf16 on CUDA GPUs that have it."""
    micro_batch: int
    """Sequences per process per micro-step."""
    grad_accum: int
    """Micro-steps per optimizer step."""
    max_steps: int
    """Optimizer steps."""
    init_from: InitFrom
    """champion: continue from the production model when it has this run's architecture and vocabulary."""
    lr: float
    """Peak learning rate (AdamW), after warmup."""
    min_lr_ratio: float
    """The cosine decay ends at this share of lr."""
    warmup_steps: int
    """Linear warmup steps."""
    weight_decay: float
    """AdamW's, on matrices only."""
    betas: tuple[float, float]
    """AdamW's."""
    grad_clip: float
    """Largest gradient norm (clipped above)."""
    activation_checkpointing: bool
    """Recompute each block's activations in the backward (less memory, more compute)."""
    compile: Switch
    """torch.compile each block; auto: on GPUs, off on CPUs."""
    reshard_after_forward: Switch
    """FSDP2: free a block's gathered weights after its forward; auto: on GPUs but the last block, off on CPUs."""
    seed: int
    """Of the initialization and the data order."""
    log_every: int
    """Steps between logged metrics."""
    eval_every: int
    """Steps between validation losses."""
    eval_batches: int
    """Validation micro-batches per evaluation."""
    checkpoint_every: int
    """Steps between checkpoints."""
    keep_last: int
    """Checkpoints kept, plus the best by val_loss."""
    async_checkpoint: bool
    """Write checkpoints in the background (the loop waits only for a copy of the weights)."""
    experiment: str
    """The MLflow experiment of training runs."""
    presets: dict[str, Preset]
    """Model sizes by name."""
    base: str = ""
    """A Hugging Face checkpoint folder the line starts from: local, s3://, or a registered MLflow
    version (models:/NAME/VERSION or models:/NAME@ALIAS: a checkpoint folder logged as a run's
    artifacts); empty: a preset from scratch. (A default: the settings models recorded before it
    replay as they were.)"""

    def __post_init__(self) -> None:
        check(self.preset in self.presets, "preset", self.preset, f"expected one of {', '.join(self.presets)}")
        positive(self, "nodes", "procs_per_node", "micro_batch", "grad_accum", "max_steps", "log_every",
                  "eval_every", "eval_batches", "checkpoint_every", "keep_last")
        at_least_zero(self, "lr", "max_restarts", "warmup_steps", "weight_decay", "grad_clip")  # lr 0: weights frozen
        fractions(self, "min_lr_ratio")
        for beta in self.betas:
            check(0 <= beta < 1, "betas", self.betas, "expected two numbers in [0, 1)")

    @property
    def model(self) -> Preset:
        """The chosen preset."""
        return self.presets[self.preset]
