"""parallelize_model: the order of the apply_* steps (tensor, expert and context parallelism,
activation checkpointing, compile, FSDP2), in place, and the per-block compile."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from kempnerforge.config.distributed import DistributedConfig
from kempnerforge.config.train import TrainConfig
from kempnerforge.core.logging import get_logger
from kempnerforge.distributed.activation_checkpointing import apply_ac
from kempnerforge.distributed.blocks import transformer_blocks
from kempnerforge.distributed.context_parallel import apply_cp
from kempnerforge.distributed.expert_parallel import apply_ep, expert_fsdp_mesh, set_router_groups
from kempnerforge.distributed.fsdp import apply_fsdp, data_parallel_mesh
from kempnerforge.distributed.pipeline_parallel import StageModule
from kempnerforge.distributed.runtime import RuntimeContext
from kempnerforge.distributed.tensor_parallel import apply_tp, has_both_ends
from kempnerforge.model.attention import set_attention_kernel
from kempnerforge.model.contract import FamilyModel
from kempnerforge.model.moe import moe_layers

logger = get_logger(__name__)


@dataclass(frozen=True)
class ParallelPlan:
    """What parallelize_model applies besides the mesh: the [distributed] fields it reads
    and the train fields that change the model: compile, mixed precision and the
    attention kernel."""

    activation_checkpointing: str = "none"
    """'none', 'full' or 'selective' (distributed.activation_checkpointing)."""
    ac_every: int = 2
    """With 'selective', checkpoint the blocks whose index is a multiple of this."""
    reshard_after_forward: bool = True
    """FSDP frees a block's gathered parameters after its forward."""
    compile: bool = False
    """torch.compile each block (train.compile); ignored under tensor parallelism."""
    bf16: bool = False
    """FSDP gathers parameters in bf16 and reduces gradients in fp32 (train.mixed_precision
    resolved for the device); False keeps both in the parameters' dtype."""
    attention_kernel: str = "auto"
    """How attention applies its mask rules (train.attention_kernel)."""

    @classmethod
    def of(
        cls, distributed: DistributedConfig, train: TrainConfig, device_type: str
    ) -> ParallelPlan:
        """The plan of a job's [distributed] and [train] sections on a ``device_type``
        ('cuda', 'cpu') device."""
        return cls(
            activation_checkpointing=distributed.activation_checkpointing,
            ac_every=distributed.ac_every,
            reshard_after_forward=distributed.reshard_after_forward,
            compile=train.compile,
            bf16=train.precision_on(device_type) == "bf16",
            attention_kernel=train.attention_kernel,
        )


def parallelize_model(
    model: FamilyModel,
    runtime: RuntimeContext,
    plan: ParallelPlan,
    roots: Sequence[StageModule] | None = None,
) -> None:
    """Apply, in place and in this order: tensor parallel, expert parallel, context
    parallel, activation checkpointing, torch.compile per block, FSDP2 (after setting
    the attention kernel, which changes no parameter).

    Meant for a model still on the meta device: nothing here allocates or reads a weight,
    so the caller then runs ``to_empty(device=...)`` and ``init_weights(seed)``, which fill
    every shard with its slice of the single-process weights. ``roots`` are the modules
    FSDP shards last (default ``[model]``); a pipeline rank passes its stage modules.
    Parameter names never change, so checkpoints read the same in every layout. With
    tensor parallelism ``plan.compile`` is ignored, with a warning: a compiled
    tensor-parallel block fails in backward in this PyTorch version.
    """
    _set_attention_kernel(model, runtime, plan.attention_kernel)
    if runtime.tp_size > 1:
        # Pipeline stages pass plain tensors, also on a rank that holds both the embedding
        # and the head (a V-shaped schedule's rank 0): judge by the stages, not the model.
        sequence_parallel = None if roots is None else all(has_both_ends(r) for r in roots)
        apply_tp(model, runtime.device_mesh["tp"], sequence_parallel=sequence_parallel)
    if runtime.mesh_size("ep") > 1:
        apply_ep(model, runtime.expert_mesh["ep"])
    set_router_groups(model, runtime)
    apply_cp(model, runtime)
    apply_ac(model, plan.activation_checkpointing, plan.ac_every)
    compiled = plan.compile and _compile_allowed(runtime)
    if compiled:
        apply_compile(model)
        if moe_layers(model):
            logger.info(
                "MoE blocks compile in pieces: the routing's host reads and the grouped "
                "expert matmuls run eagerly between compiled graphs"
            )
    if runtime.mesh_size("dp_cp") > 1:
        apply_fsdp(
            model,
            data_parallel_mesh(runtime),
            param_dtype=torch.bfloat16 if plan.bf16 else None,
            reduce_dtype=torch.float32 if plan.bf16 else None,
            reshard_after_forward=plan.reshard_after_forward,
            roots=roots,
            expert_mesh=expert_fsdp_mesh(runtime),
        )
    logger.info(
        "parallelized: tp %d, cp %d, dp %d (replicate %d x shard %d), ep %d, activation "
        "checkpointing %s, compile %s",
        runtime.tp_size,
        runtime.cp_size,
        runtime.dp_size,
        runtime.mesh_size("dp_replicate"),
        runtime.mesh_size("dp_shard"),
        runtime.mesh_size("ep"),
        plan.activation_checkpointing,
        compiled,
    )


def _set_attention_kernel(model: FamilyModel, runtime: RuntimeContext, kernel: str) -> None:
    """train.attention_kernel on the model, with a warning where a ring leaves it unused:
    ring attention applies each layer's rule with its own block kernels."""
    set_attention_kernel(model, kernel)
    if kernel != "auto" and runtime.cp_ring > 1:
        logger.warning(
            "train.attention_kernel = %r does nothing to ring attention (distributed.cp "
            "runs a ring of %d ranks): the ring applies each layer's mask rule with its own "
            "block kernels; only the whole-sequence sample uses it",
            kernel,
            runtime.cp_ring,
        )


def _compile_allowed(runtime: RuntimeContext) -> bool:
    """False, with a warning, where train.compile cannot work: with tensor parallelism."""
    if runtime.tp_size == 1:
        return True
    # TODO(torch): compiled tensor-parallel blocks fail in backward (a DTensor
    # redistribution receives a plain gradient) with both inductor and aot_eager.
    logger.warning(
        "train.compile is ignored with distributed.tp = %d: compiling tensor-parallel "
        "blocks fails in backward in this PyTorch version; the blocks run eagerly",
        runtime.tp_size,
    )
    return False


def apply_compile(model: FamilyModel, *, backend: str = "inductor") -> None:
    """Compile each block in place (``Module.compile``), keeping parameter names.

    Per block rather than the whole model: identical blocks reuse one compiled graph, and
    FSDP's per-block hooks stay outside it. ``backend`` exists for tests ('aot_eager').
    """
    for _, block in transformer_blocks(model):
        block.compile(backend=backend)
