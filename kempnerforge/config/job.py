"""JobConfig: every section of one run, and the rules that span sections."""

from __future__ import annotations

import importlib.util
import logging
import math
import os
from dataclasses import dataclass, field

from kempnerforge.config.checkpoint import CheckpointConfig
from kempnerforge.config.context_parallel import check_context_parallel
from kempnerforge.config.data import DataConfig
from kempnerforge.config.distributed import DistributedConfig
from kempnerforge.config.eval import EvalConfig, missing_eval_data
from kempnerforge.config.fault_tolerance import FaultToleranceConfig
from kempnerforge.config.float8 import check_float8_config
from kempnerforge.config.metrics import MetricsConfig
from kempnerforge.config.model import ModelConfig
from kempnerforge.config.optimizer import OptimizerConfig
from kempnerforge.config.pipeline_schedule import check_pipeline_schedule
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
from kempnerforge.core.errors import ConfigError, closest_name

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
        self._validate_layout(world_size)
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
        self._validate_phases()
        self._validate_mixture_weights()
        check_float8_config(self)
        # A vision-language job's sequence is its image tokens plus vlm.max_text_len
        # (checked in _validate_vlm); train.seq_len is not used by it.
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
        if self.vlm is not None:
            self._validate_vlm()
        if self.eval.enabled and (why := missing_eval_data(self.data, self.eval, self.vlm)):
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

    def _validate_vlm(self) -> None:
        """A VLM against the layout and the decoder: the encoder's shape is read here, so a
        bad tower directory or image size fails before anything is built."""
        assert self.vlm is not None and self.adapter is not None
        model, vlm = self.model, self.vlm
        spec = self.vision_spec()
        if self.adapter.type == "pool" and spec.grid % self.adapter.pool_window:
            raise ConfigError(
                "adapter.pool_window",
                self.adapter.pool_window,
                f"a divisor of the encoder's token grid side {spec.grid}",
                f"the encoder gives {spec.num_tokens} tokens per image",
            )
        positions = self.decoder_positions(spec)
        if positions > model.max_seq_len:
            image = positions - vlm.max_text_len
            raise ConfigError(
                "vlm.max_text_len",
                vlm.max_text_len,
                f"<= model.max_seq_len - image tokens = {model.max_seq_len} - {image}",
                "the joint decoder's sequence is the image tokens then the text; raise "
                "model.max_seq_len or lower vlm.max_text_len",
            )
        data = self.data
        for field_name, value in (
            ("data.path", data.path),
            ("data.eval_path", data.eval_path),
            ("data.datasets", data.datasets),
            ("eval.sets", self.eval.sets),
        ):
            if value:
                raise ConfigError(
                    field_name,
                    value,
                    "empty for a vision-language job ([vlm])",
                    "it names token data; give image-text pairs with vlm.data and "
                    "vlm.eval_data (jsonl indexes)",
                )
        if vlm.arch == "cross_attention" and vlm.cross_attention_every_n_layers > model.n_layers:
            raise ConfigError(
                "vlm.cross_attention_every_n_layers",
                vlm.cross_attention_every_n_layers,
                f"<= model.n_layers = {model.n_layers}",
                "otherwise no decoder layer is followed by a cross-attention block",
            )

    def _validate_layout(self, world_size: int) -> None:
        """The [distributed] mesh must fit the world size and the model; runs on every rank
        before any collective, so a bad layout fails the same way everywhere."""
        dist, model, train = self.distributed, self.model, self.train
        shape = dist.mesh_shape(world_size)
        product = math.prod(shape.values())
        if shape["dp_shard"] == 0 or product != world_size:
            named = " * ".join(f"{k} {v}" for k, v in shape.items() if k != "dp_shard")
            raise ConfigError(
                "distributed.dp_shard",
                dist.dp_shard,
                f"dp_replicate * dp_shard * cp * tp * pp == world size {world_size}",
                f"{named} leaves no whole dp_shard"
                if shape["dp_shard"] == 0
                else f"the mesh {shape} holds {product} processes",
            )
        if dist.tp > 1:
            for name, heads in (("n_heads", model.n_heads), ("n_kv_heads", model.kv_heads)):
                if heads % dist.tp:
                    raise ConfigError(
                        "distributed.tp",
                        dist.tp,
                        f"a divisor of model.{name} = {heads}",
                        "each tensor-parallel rank holds whole attention heads",
                    )
            if model.hidden_dim % dist.tp:
                raise ConfigError(
                    "distributed.tp",
                    dist.tp,
                    f"a divisor of the feed-forward size {model.hidden_dim}",
                    "set model.ffn_hidden_dim or model.multiple_of",
                )
        if self.vlm is not None:
            for name, degree in (("pp", dist.pp), ("tp", dist.tp)):
                if degree > 1:
                    raise ConfigError(
                        f"distributed.{name}",
                        degree,
                        "1 for a vision-language model ([vlm])",
                        "the vision encoder, the adapter and the cross-attention blocks are "
                        "not split into pipeline stages or tensor-parallel shards; use "
                        "distributed.dp_shard (FSDP) to spread a VLM over devices",
                    )
        check_context_parallel(dist, model, train, self.vlm is not None)
        self._validate_pipeline()
        check_pipeline_schedule(dist, train, dist.resolved_dp(world_size))
        self._validate_experts(shape["dp_shard"])
        sharded = shape["dp_shard"] * dist.cp > 1  # FSDP shards over dp_shard x cp
        if self.optimizer.name == "muon" and (sharded or dist.tp > 1):
            raise ConfigError(
                "optimizer.name",
                "muon",
                "an optimizer other than 'muon' when parameters are sharded "
                "(distributed.dp_shard * distributed.cp > 1 or distributed.tp > 1)",
                "Muon orthogonalises whole matrices and each rank holds only a shard; "
                "use 'adamw', or data parallelism by replication (distributed.dp_replicate)",
            )
        dp = dist.resolved_dp(world_size)
        if train.global_batch_size and train.global_batch_size % dp:
            raise ConfigError(
                "train.global_batch_size",
                train.global_batch_size,
                f"a multiple of the data-parallel degree {dp} (dp_replicate * dp_shard)",
                "the global batch does not split evenly over the data-parallel ranks",
            )

    def _validate_pipeline(self) -> None:
        dist, model, train = self.distributed, self.model, self.train
        if dist.pp == 1:
            if dist.pp_split_points:
                raise ConfigError(
                    "distributed.pp_split_points",
                    dist.pp_split_points,
                    "[] when distributed.pp = 1",
                )
            return
        stages = dist.num_stages
        if stages > model.n_layers:
            raise ConfigError(
                "distributed.pp",
                dist.pp,
                f"pp * stages per rank ({stages}) <= model.n_layers = {model.n_layers}",
                "every pipeline stage needs at least one layer",
            )
        points = dist.pp_split_points
        if points and (len(points) != stages - 1 or points[-1] >= model.n_layers):
            raise ConfigError(
                "distributed.pp_split_points",
                points,
                f"{stages - 1} increasing layer indices in [1, {model.n_layers - 1}] "
                f"(one per stage after the first, {stages} stages)",
            )
        if model.tie_embeddings:
            raise ConfigError(
                "model.tie_embeddings",
                True,
                "false with distributed.pp > 1",
                "the embedding and the output head live on different pipeline stages",
            )
        if self.data.document_masking:
            raise ConfigError(
                "data.document_masking",
                True,
                "false with distributed.pp > 1",
                "pipeline stages pass hidden states only, not the document ids: set "
                "data.document_masking = false to train across document boundaries",
            )
        if train.grad_accum_steps < dist.pp or train.grad_accum_steps % dist.pp:
            raise ConfigError(
                "train.grad_accum_steps",
                train.grad_accum_steps,
                f"a multiple of distributed.pp = {dist.pp}",
                "the pipeline's micro-batches are the step's micro-batches; each stage "
                "needs whole rounds of them",
            )

    def _validate_experts(self, dp_shard: int) -> None:
        """MoE against the layout: expert parallelism splits the experts over data-parallel
        shard ranks (of each pipeline stage); tensor parallelism does not split experts."""
        dist, model = self.distributed, self.model
        if not model.is_moe:
            if dist.ep > 1:
                raise ConfigError(
                    "distributed.ep",
                    dist.ep,
                    "1 for a dense model (model.num_experts = 0)",
                    "expert parallelism splits the experts of MoE layers",
                )
            return
        if dist.tp > 1:
            raise ConfigError(
                "distributed.tp",
                dist.tp,
                "1 with an MoE model (model.num_experts > 0)",
                "experts are not split by tensor parallelism; use distributed.ep to split "
                "the experts over ranks",
            )
        if model.num_experts % dist.ep:
            raise ConfigError(
                "distributed.ep",
                dist.ep,
                f"a divisor of model.num_experts = {model.num_experts}",
                "each expert-parallel rank holds the same number of whole experts",
            )
        if dp_shard % dist.ep:
            raise ConfigError(
                "distributed.ep",
                dist.ep,
                f"a divisor of distributed.dp_shard = {dp_shard}",
                "expert-parallel ranks are data-parallel shard ranks that exchange tokens",
            )

    def _validate_mixture_weights(self) -> None:
        """The sampler draws source i with probability w_i ** (1 / data.mix_temperature) over
        their sum, for the weights in force at each phase: that must be a finite, non-zero sum
        of finite floats (a low temperature overflows large weights and flushes small ones to
        0)."""
        if not self.data.datasets:
            return
        temperature = self.data.mix_temperature
        in_force = {d.name: float(d.weight) for d in self.data.datasets}
        where = "data.datasets weights"
        for i, phase in enumerate([None, *self.train.phases]):
            if phase is not None:
                in_force.update(phase.dataset_weights)
                where = f"the weights in force from train.phases[{i - 1}]"
            try:
                scaled = [w ** (1.0 / temperature) for w in in_force.values() if w > 0]
            except OverflowError:
                scaled = [math.inf]
            total = sum(scaled)  # inf when it overflows (math.fsum would raise)
            if not (math.isfinite(total) and total > 0):
                raise ConfigError(
                    "data.mix_temperature",
                    temperature,
                    "a temperature for which every weight ** (1 / temperature) and their sum "
                    "are finite and not all 0",
                    f"{where} are {in_force}",
                )

    def _validate_phases(self) -> None:
        """Phase weights must name mixture datasets and leave some weight on.

        Phases fire in order and each updates the weights in force, so the check follows
        them: a later phase may zero the last source an earlier one left on.
        """
        configured = {d.name: d.weight for d in self.data.datasets}
        in_force = dict(configured)
        for i, phase in enumerate(self.train.phases):
            field = f"train.phases[{i}].dataset_weights"
            if phase.dataset_weights and not configured:
                raise ConfigError(
                    field,
                    phase.dataset_weights,
                    "no weights without a mixture",
                    "phase weights need [[data.datasets]]",
                )
            for name in phase.dataset_weights:
                if name not in configured:
                    suggestion = closest_name(name, configured)
                    raise ConfigError(
                        f"{field}.{name}",
                        name,
                        "a data.datasets name: " + ", ".join(configured),
                        f"did you mean {suggestion!r}?" if suggestion else "",
                    )
            in_force.update(phase.dataset_weights)
            if phase.dataset_weights and not any(in_force.values()):
                raise ConfigError(
                    field,
                    phase.dataset_weights,
                    "at least one weight > 0 in force",
                    f"after this phase the weights are {in_force}",
                )
