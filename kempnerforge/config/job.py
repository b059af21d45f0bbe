"""JobConfig: every section of one run, and the rules that span sections."""

from __future__ import annotations

import importlib.util
import logging
import os
from dataclasses import dataclass, field

from kempnerforge.config.checkpoint import CheckpointConfig
from kempnerforge.config.data import DataConfig
from kempnerforge.config.distributed import DistributedConfig
from kempnerforge.config.dpo import DPOConfig, check_dpo_job
from kempnerforge.config.eval import EvalConfig, missing_eval_data
from kempnerforge.config.fault_tolerance import FaultToleranceConfig
from kempnerforge.config.float8 import check_float8_config
from kempnerforge.config.grpo import GRPOConfig, check_grpo_job
from kempnerforge.config.layout_rules import check_parallel_layout
from kempnerforge.config.lora import LoRAConfig, check_lora_job
from kempnerforge.config.metrics import MetricsConfig
from kempnerforge.config.mixture_weights import check_mixture_weights, check_phase_weights
from kempnerforge.config.model import ModelConfig
from kempnerforge.config.mtp_rules import check_mtp_job
from kempnerforge.config.optimizer import OptimizerConfig
from kempnerforge.config.profiling import ProfilingConfig
from kempnerforge.config.scheduler import SchedulerConfig
from kempnerforge.config.train import TrainConfig
from kempnerforge.config.vlm import (
    AdapterConfig,
    VisionEncoderConfig,
    VisionSpec,
    VLMConfig,
    resolve_vision,
)
from kempnerforge.config.vlm import check_job as check_vlm_job
from kempnerforge.core.errors import ConfigError

logger = logging.getLogger(__name__)


@dataclass
class JobConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    data: DataConfig = field(default_factory=DataConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    distributed: DistributedConfig = field(default_factory=DistributedConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    metrics: MetricsConfig = field(default_factory=MetricsConfig)
    profiling: ProfilingConfig = field(default_factory=ProfilingConfig)
    fault_tolerance: FaultToleranceConfig = field(default_factory=FaultToleranceConfig)
    lora: LoRAConfig = field(default_factory=LoRAConfig)
    dpo: DPOConfig = field(default_factory=DPOConfig)
    grpo: GRPOConfig = field(default_factory=GRPOConfig)
    vision_encoder: VisionEncoderConfig | None = None
    adapter: AdapterConfig | None = None
    vlm: VLMConfig | None = None

    def __post_init__(self) -> None:
        if self.vlm is None:
            for name in ("vision_encoder", "adapter"):
                if getattr(self, name) is not None:
                    raise ConfigError(
                        name, f"[{name}]", "a [vlm] table beside it", "it configures a VLM"
                    )
            return
        if self.vision_encoder is None:
            raise ConfigError(
                "vlm", "[vlm]", "a [vision_encoder] table beside it", "a VLM needs an encoder"
            )
        if self.adapter is None:
            self.adapter = AdapterConfig()

    @property
    def is_vlm(self) -> bool:
        """True for a vision-language job: one with a [vlm] table."""
        return self.vlm is not None

    def vision_spec(self) -> VisionSpec:
        """The encoder's shape (see config/vlm.py); reads the tower's config files."""
        if self.vision_encoder is None:
            raise ValueError("vision_spec() of a job without [vision_encoder]")
        return resolve_vision(self.vision_encoder)

    def image_tokens(self, spec: VisionSpec) -> int:
        """Adapted tokens per image: the encoder's, fewer after a pooling adapter."""
        adapter = self.adapter or AdapterConfig()
        if adapter.type == "pool":
            return (spec.grid // adapter.pool_window) ** 2
        return spec.num_tokens

    def decoder_positions(self, spec: VisionSpec) -> int:
        """Positions of the decoder's sequence for one sample: the image tokens (joint
        decoder only) and the text."""
        assert self.vlm is not None
        residual = self.image_tokens(spec) if self.vlm.arch == "joint_decoder" else 0
        return residual + self.vlm.max_text_len

    @property
    def job_dir(self) -> str:
        """The job's directory: train.run_dir, or runs/<train.name>."""
        return self.train.run_dir or os.path.join("runs", self.train.name)

    @property
    def run_dir(self) -> str:
        """Where this launch writes its config, metrics and lock: the job's directory, or
        with replica groups its group's own replica_<id> inside it (groups of one job must
        not lock each other out)."""
        ft = self.fault_tolerance
        if ft.enabled:
            return os.path.join(self.job_dir, f"replica_{ft.group_id()}")
        return self.job_dir

    @property
    def checkpoint_dir(self) -> str:
        """checkpoint.dir, or <job dir>/checkpoints: one per job, also with replica groups."""
        return self.checkpoint.dir or os.path.join(self.job_dir, "checkpoints")

    @property
    def num_replica_groups(self) -> int:
        """The replica groups the global batch is designed for: 1 without fault_tolerance."""
        ft = self.fault_tolerance
        return ft.num_replica_groups if ft.enabled else 1

    def validate(self, world_size: int) -> None:
        """Check the rules that span sections or need the world size; raise ConfigError.

        Section-local rules already ran in each section's __post_init__. The first broken
        rule wins, so the order below is the order a user fixes things in.
        """
        if world_size < 1:
            raise ValueError(f"world_size must be >= 1, got {world_size}")
        dist, model, train = self.distributed, self.model, self.train
        self._validate_fault_tolerance()
        if self.vlm is not None:
            check_vlm_job(self)
        check_parallel_layout(self, world_size)
        check_mtp_job(self)
        dp = dist.resolved_dp(world_size)
        groups = self.num_replica_groups
        per_step = train.batch_size * train.grad_accum_steps * dp * groups
        if train.global_batch_size and train.global_batch_size != per_step:
            by_groups = " * fault_tolerance.num_replica_groups" if groups > 1 else ""
            times_groups = f" * {groups}" if groups > 1 else ""
            raise ConfigError(
                "train.global_batch_size",
                train.global_batch_size,
                f"batch_size * grad_accum_steps * dp{by_groups} = {train.batch_size} * "
                f"{train.grad_accum_steps} * {dp}{times_groups} = {per_step}",
                "change train.grad_accum_steps or train.batch_size to keep the global batch",
            )
        check_phase_weights(self)
        check_mixture_weights(self)
        check_float8_config(self)
        check_lora_job(self)
        check_dpo_job(self)
        check_grpo_job(self)
        if self.checkpoint.memory_interval and self.fault_tolerance.enabled:
            raise ConfigError(
                "checkpoint.memory_interval",
                self.checkpoint.memory_interval,
                "0 with fault_tolerance.enabled",
                "a relaunched replica group takes a live peer's state, which is newer",
            )
        # A vision-language job's sequence is its image tokens plus vlm.max_text_len
        # (checked in config/vlm.py's check_job); train.seq_len is not used by it.
        if train.seq_len > model.max_seq_len and not self.is_vlm:
            raise ConfigError(
                "train.seq_len", train.seq_len, f"<= model.max_seq_len = {model.max_seq_len}"
            )
        if self.scheduler.name != "none" and self.scheduler.warmup_steps > train.max_steps:
            # A short run of a long config (--train.max_steps=5 for a smoke test) is fine:
            # the schedule warms up over the whole run instead (see lr_factor).
            logger.warning(
                "scheduler.warmup_steps = %d is longer than train.max_steps = %d: warming up "
                "over %d steps instead, so the learning rate peaks at the last step",
                self.scheduler.warmup_steps,
                train.max_steps,
                train.max_steps,
            )
        if self.eval.enabled and (why := missing_eval_data(self.data, self.eval)):
            logger.warning(
                "eval.interval = %d but this job has no held-out data, so training skips eval: %s",
                self.eval.interval,
                why,
            )
        if self.profiling.enable and self.profiling.start_step > train.max_steps:
            raise ConfigError(
                "profiling.start_step",
                self.profiling.start_step,
                f"<= train.max_steps = {train.max_steps} when profiling.enable is true",
            )

    def _validate_fault_tolerance(self) -> None:
        """Replica groups: the group id and lighthouse are known, and nothing they do not
        support is on (pipeline stages, mixture weight changes, the torchft extra missing)."""
        ft = self.fault_tolerance
        if not ft.enabled:
            return
        ft.group_id()
        ft.lighthouse_address()
        if self.distributed.pp > 1:
            raise ConfigError(
                "distributed.pp",
                self.distributed.pp,
                "1 with fault_tolerance.enabled",
                "replica groups do not support pipeline parallelism; use FSDP/TP in a group",
            )
        for i, phase in enumerate(self.train.phases):
            if phase.dataset_weights:
                raise ConfigError(
                    f"train.phases[{i}].dataset_weights",
                    phase.dataset_weights,
                    "empty with fault_tolerance.enabled",
                    "replica groups read a fixed data order; mixture weight changes are "
                    "not supported",
                )
        if importlib.util.find_spec("torchft") is None:
            raise ConfigError(
                "fault_tolerance.enabled",
                True,
                "false, or torchft installed",
                "install the ft extra: pip install 'kempnerforge[ft]'",
            )
