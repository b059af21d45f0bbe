"""[distributed]: how the world of processes is split into parallel dimensions.

The processes form a mesh of five named dimensions, outermost first:
``pp`` (pipeline stages), ``dp_replicate`` (HSDP replicas), ``dp_shard`` (FSDP shards),
``cp`` (context parallel: slices of every sequence) and ``tp`` (tensor parallel). Their
product is the world size; ``dp_shard = -1`` takes whatever the others leave.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kempnerforge.config.checks import MAX_SIZE, check_at_least, check_choice, check_positive
from kempnerforge.core.errors import ConfigError

MAX_TIMEOUT_S = 30 * 24 * 3600.0
MESH_DIMS = ("pp", "dp_replicate", "dp_shard", "cp", "tp")
"""The mesh's dimension names, outermost (slowest-varying rank) first."""
PP_SCHEDULES = ("gpipe", "1f1b", "interleaved_1f1b", "interleaved_zb", "zbv", "dualpipev")
LOOP_SCHEDULES = ("interleaved_1f1b", "interleaved_zb")
"""Schedules that run 2 or more stages per pipeline rank, placed in a loop: rank r holds
stages r, r + pp, r + 2 * pp, ..."""
V_SCHEDULES = ("zbv", "dualpipev")
"""Schedules that run exactly 2 stages per pipeline rank, placed in a V: rank r holds
stages r and 2 * pp - 1 - r, so rank 0 holds the first and the last stage."""
ZERO_BUBBLE_SCHEDULES = ("interleaved_zb", "zbv", "dualpipev")
"""Schedules that split each backward into its input and its weight gradients, and run
the weight part where a rank would otherwise wait."""
AC_MODES = ("none", "full", "selective")
CP_ATTENTION = ("auto", "ulysses", "ring")
"""How context-parallel ranks share attention (DistributedConfig.cp_attention)."""


@dataclass
class DistributedConfig:
    dp_shard: int = -1
    """FSDP degree: processes that each hold a shard of every parameter (1 to 2**31 - 1);
    -1 takes whatever dp_replicate, cp, tp and pp leave of the world size."""
    dp_replicate: int = 1
    """HSDP degree: full replicas of the sharded model, each over dp_shard processes; the
    data-parallel degree is dp_replicate * dp_shard. 1 to 2**31 - 1."""
    tp: int = 1
    """Tensor-parallel degree, in processes; must divide model.n_heads and the key/value
    heads. 1 to 2**31 - 1."""
    ep: int = 1
    """Expert-parallel degree: the routed experts of every MoE layer are split over this
    many of the dp_shard ranks (dp_shard x cp ranks with context parallelism), which send
    each token to the rank holding its expert (all-to-all) and back. Must divide dp_shard
    (times cp) and model.num_experts, and be 1 with tp > 1 (tensor parallelism splits each
    expert's hidden features instead); 1 to 2**31 - 1."""
    cp: int = 1
    """Context-parallel degree: each of these processes holds a 1/cp slice of every
    sequence, and attention reaches the rest of it as cp_attention says; they hold the
    same weights and count as data-parallel peers in the gradient reduction. Must divide
    train.seq_len (a vision-language model's decoder sequence instead: image tokens +
    vlm.max_text_len with the joint decoder, vlm.max_text_len with cross-attention); the
    heads bound the Ulysses ranks (cp_ulysses); 1 to 2**31 - 1."""
    cp_attention: str = "auto"
    """How the cp ranks share attention: 'ulysses' (exchange heads for whole sequences,
    all-to-all: cp must divide each tp rank's query heads, and divide its key/value heads
    or be a multiple of them), 'ring' (key/value blocks passed around a ring of cp /
    cp_ulysses ranks; ring rank i holds chunks i and 2 * ring - 1 - i of 2 * ring equal
    chunks of every sequence, so 2 * ring must divide it; the heads bound only
    cp_ulysses), or 'auto': 'ulysses' where the heads allow cp, else 'ring' with the
    largest cp_ulysses they allow (docs/distributed.md)."""
    cp_ulysses: int = 0
    """Ulysses ranks inside each ring rank (cp_attention 'ring' or 'auto'): consecutive cp
    ranks that exchange heads before the ring runs over their chunks, so cp = cp_ulysses
    x ring; must divide cp, and the heads as cp does under 'ulysses'. 0 picks: cp under
    'ulysses', 1 (a pure ring) under 'ring', the largest the heads allow under 'auto'."""
    pp: int = 1
    """Pipeline-parallel degree (processes along the pipeline); 1 to 2**31 - 1."""
    pp_schedule: str = "1f1b"
    """Pipeline schedule: 'gpipe', '1f1b', 'interleaved_1f1b', or a zero-bubble one:
    'interleaved_zb', 'zbv' or 'dualpipev' (docs/distributed.md says when each pays).
    The micro-batches of a step are train.grad_accum_steps."""
    pp_stages_per_rank: int = 0
    """Pipeline stages each pipeline rank holds; 0 means 1, or 2 for 'interleaved_1f1b'
    and 'interleaved_zb' (which need at least 2) and for 'zbv' and 'dualpipev' (which
    need exactly 2). 0 to 64."""
    pp_split_points: list[int] = field(default_factory=list)
    """Layer indices where pipeline stages 1, 2, ... begin (pp * stages per rank - 1 of
    them, increasing); empty splits the layers evenly."""
    activation_checkpointing: str = "none"
    """Recompute activations in backward instead of keeping them: 'none', 'full' (every
    block) or 'selective' (every ac_every-th block)."""
    ac_every: int = 2
    """With activation_checkpointing = 'selective', checkpoint blocks 0, N, 2N, ...;
    1 to 2**31 - 1."""
    reshard_after_forward: bool = True
    """FSDP: free gathered parameters after each block's forward (gather again in
    backward). False keeps them, trading memory for one all-gather per block and step."""
    backend: str = "auto"
    """Process-group backend: 'auto' (nccl on CUDA, gloo on CPU), 'gloo' or 'nccl'."""
    timeout_s: float = 1800.0
    """How long a collective may wait for a peer, in seconds, before the run fails naming
    it; > 0 and at most 2592000 (30 days)."""

    def __post_init__(self) -> None:
        if self.dp_shard != -1:
            check_positive("distributed.dp_shard", self.dp_shard, MAX_SIZE)
        check_positive("distributed.dp_replicate", self.dp_replicate, MAX_SIZE)
        check_positive("distributed.tp", self.tp, MAX_SIZE)
        check_positive("distributed.pp", self.pp, MAX_SIZE)
        check_positive("distributed.ep", self.ep, MAX_SIZE)
        check_positive("distributed.cp", self.cp, MAX_SIZE)
        check_choice("distributed.cp_attention", self.cp_attention, CP_ATTENTION)
        check_at_least("distributed.cp_ulysses", self.cp_ulysses, 0, MAX_SIZE)
        self._check_cp_ulysses()
        check_choice("distributed.pp_schedule", self.pp_schedule, PP_SCHEDULES)
        check_at_least("distributed.pp_stages_per_rank", self.pp_stages_per_rank, 0, 64)
        self._check_stages_per_rank()
        for i, point in enumerate(self.pp_split_points):
            check_positive(f"distributed.pp_split_points[{i}]", point, MAX_SIZE)
        for i, (a, b) in enumerate(
            zip(self.pp_split_points, self.pp_split_points[1:], strict=False)
        ):
            if b <= a:
                raise ConfigError(
                    f"distributed.pp_split_points[{i + 1}]", b, f"> {a} (increasing layers)"
                )
        check_choice(
            "distributed.activation_checkpointing", self.activation_checkpointing, AC_MODES
        )
        check_positive("distributed.ac_every", self.ac_every, MAX_SIZE)
        # The timeout becomes a timedelta and a millisecond count in the process-group
        # backends; 30 days is longer than any job a scheduler keeps alive.
        check_positive("distributed.timeout_s", self.timeout_s, MAX_TIMEOUT_S)
        check_choice("distributed.backend", self.backend, ("auto", "gloo", "nccl"))

    def _check_cp_ulysses(self) -> None:
        """cp_ulysses against cp and cp_attention."""
        cp, ulysses, attention = self.cp, self.cp_ulysses, self.cp_attention
        if ulysses == 0:
            return
        if cp % ulysses:
            raise ConfigError(
                "distributed.cp_ulysses",
                ulysses,
                f"0 or a divisor of distributed.cp = {cp}",
                "cp = cp_ulysses x the ring's ranks",
            )
        if attention == "ulysses" and ulysses != cp:
            raise ConfigError(
                "distributed.cp_ulysses",
                ulysses,
                f"0 or {cp} (distributed.cp) with cp_attention = 'ulysses'",
                "set cp_attention = 'ring' for Ulysses ranks inside a ring",
            )
        if attention == "ring" and ulysses == cp and cp > 1:
            raise ConfigError(
                "distributed.cp_ulysses",
                ulysses,
                f"a divisor of distributed.cp = {cp} below it with cp_attention = 'ring'",
                "cp_ulysses = cp leaves a ring of one rank; use cp_attention = 'ulysses'",
            )

    def _check_stages_per_rank(self) -> None:
        """pp_stages_per_rank against what pp_schedule can run."""
        schedule, per_rank = self.pp_schedule, self.pp_stages_per_rank
        if schedule in LOOP_SCHEDULES and per_rank == 1:
            raise ConfigError(
                "distributed.pp_stages_per_rank",
                1,
                f"0 or at least 2 with pp_schedule = {schedule!r}",
                "an interleaved schedule runs several stages on each rank",
            )
        if schedule in V_SCHEDULES and per_rank not in (0, 2):
            raise ConfigError(
                "distributed.pp_stages_per_rank",
                per_rank,
                f"0 or 2 with pp_schedule = {schedule!r}",
                "a V-shaped schedule runs exactly two stages on each rank",
            )
        if schedule not in (*LOOP_SCHEDULES, *V_SCHEDULES) and per_rank > 1:
            raise ConfigError(
                "distributed.pp_stages_per_rank",
                per_rank,
                f"0 or 1 with pp_schedule = {schedule!r}",
                "use pp_schedule = 'interleaved_1f1b' or 'interleaved_zb' for several "
                "stages per rank",
            )

    @property
    def stages_per_rank(self) -> int:
        """Pipeline stages per pipeline rank, 0 resolved."""
        if self.pp_stages_per_rank:
            return self.pp_stages_per_rank
        return 2 if self.pp_schedule in (*LOOP_SCHEDULES, *V_SCHEDULES) else 1

    @property
    def v_shaped(self) -> bool:
        """Whether pp_schedule places a rank's two stages in a V (V_SCHEDULES) rather
        than in a loop."""
        return self.pp_schedule in V_SCHEDULES

    @property
    def num_stages(self) -> int:
        """Pipeline stages in all (1 without pipeline parallelism)."""
        return self.pp * self.stages_per_rank if self.pp > 1 else 1

    def resolved_dp_shard(self, world_size: int) -> int:
        """dp_shard for this world size (-1 resolved; 0 when nothing divides)."""
        if self.dp_shard != -1:
            return self.dp_shard
        others = self.dp_replicate * self.cp * self.tp * self.pp
        return world_size // others if world_size % others == 0 else 0

    def resolved_dp(self, world_size: int) -> int:
        """Data-parallel degree for this world size: dp_replicate * dp_shard."""
        return max(self.dp_replicate * self.resolved_dp_shard(world_size), 1)

    def mesh_shape(self, world_size: int) -> dict[str, int]:
        """Size of each mesh dimension, outermost first (dp_shard = -1 resolved).

        ``cp`` is left out when it is 1: on gloo a mesh creates every subgroup of every
        dimension on every rank, so a size-1 dimension would cost one new_group call per
        rank of the world at start-up for nothing.
        """
        shape = {
            "pp": self.pp,
            "dp_replicate": self.dp_replicate,
            "dp_shard": self.resolved_dp_shard(world_size),
            "cp": self.cp,
            "tp": self.tp,
        }
        if self.cp == 1:
            del shape["cp"]
        return shape
