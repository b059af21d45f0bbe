"""[train]: what one run trains, for how long, and how each step is done."""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from kempnerforge.config.checks import (
    MAX_LOSS_WEIGHT,
    MAX_LR,
    MAX_SEED,
    MAX_SIZE,
    MAX_STEPS,
    check_at_least,
    check_choice,
    check_in_range,
    check_positive,
)
from kempnerforge.core.errors import ConfigError

# A run name becomes a directory under runs/: one path component that is never '.', '..',
# hidden, or taken for a command-line option, and that every filesystem spells the same way.
RUN_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9._-]{0,127}")
RUN_NAME_RULE = "1 to 128 of [A-Za-z0-9._-], not starting with '.' or '-'"
MAX_THREADS = 65536
"""More intra-op threads than any machine has cores."""
MAX_HANG_TIMEOUT_S = 1e7
"""About four months: longer than any step, so any larger value is a typo."""


@dataclass
class PhaseConfig:
    """One [[train.phases]] entry: from start_step on, new mixture weights and an LR scale."""

    start_step: int = 0
    """Optimizer step from which the phase applies (0: from the first step); at most
    2**62 - 1."""
    dataset_weights: dict[str, float] = field(default_factory=dict)
    """Mixture weights by data.datasets name; datasets not named keep the weight in force
    (the configured one, or the one an earlier phase set)."""
    lr_scale: float = 1.0
    """Multiplies the scheduler's learning rate while this phase is in force; > 0 and at
    most 10."""

    def check(self, field: str) -> None:
        """Section-local rules; ``field`` is this entry's dotted name (train.phases[i])."""
        check_at_least(f"{field}.start_step", self.start_step, 0, MAX_STEPS)
        check_positive(f"{field}.lr_scale", self.lr_scale, MAX_LR)
        for name, weight in self.dataset_weights.items():
            check_at_least(f"{field}.dataset_weights.{name}", weight, 0.0)


DEVICES = ("auto", "cpu", "cuda")
PRECISIONS = ("auto", "fp32", "bf16")
ALLOCATORS = ("auto", "tcmalloc", "jemalloc", "glibc", "system")
ATTENTION_KERNELS = ("auto", "dense")


@dataclass
class TrainConfig:
    name: str = "debug"
    """Run name; also the default run directory runs/<name>. 1 to 128 letters, digits, '.',
    '_' or '-', not starting with '.' or '-' (so never '.', '..', a path or an option)."""
    run_dir: str = ""
    """Directory for config.toml, metrics.jsonl and checkpoints/; empty means runs/<name>."""
    use_existing_dir: bool = False
    """Allow run_dir or checkpoint.dir to be an existing, non-empty directory that no run
    wrote (by default such a directory is refused, so a typo never writes into it). A
    run_dir holding a config.toml, metrics.jsonl or config_history/ that no run wrote (it
    has no .kempnerforge-run) is refused even so: the run would overwrite them."""
    batch_size: int = 8
    """Micro-batch size per data-parallel rank, in sequences; 1 to 2**31 - 1."""
    seq_len: int = 256
    """Tokens per training sequence; at most model.max_seq_len."""
    max_steps: int = 1000
    """Optimizer steps to train for, 1 to 2**62 - 1; a resumed run continues up to this
    step."""
    grad_accum_steps: int = 1
    """Micro-batches accumulated into one optimizer step; 1 to 2**31 - 1."""
    global_batch_size: int = 0
    """Optional guard, in sequences per optimizer step: when > 0 it must equal
    batch_size * grad_accum_steps * data-parallel degree, so a relaunch at another world
    size cannot silently change the batch. 0 skips the check; at most 2**62 - 1."""
    grad_clip_norm: float = 1.0
    """Clip the global gradient L2 norm to this; 0 disables clipping (the norm is still
    logged); at most 1e6."""
    seed: int = 42
    """Seeds model init, data order and every RNG (python, numpy, torch); 0 to 2**63 - 1."""
    deterministic: bool = False
    """Use deterministic kernels so that a CPU run repeats bitwise (slower on GPU)."""
    device: str = "auto"
    """'auto' (CUDA when available, else CPU), 'cpu' or 'cuda'."""
    mixed_precision: str = "auto"
    """'bf16' computes forward/backward in bf16 (autocast; sharded models gather bf16
    parameters and reduce gradients in fp32); parameters and optimizer stay fp32. 'fp32'
    computes in fp32. 'auto' is bf16 on CUDA and fp32 on CPU."""
    compile: bool = False
    """Compile the model with torch.compile before training."""
    attention_kernel: str = "auto"
    """How attention applies a mask rule (packed documents, sliding windows; see
    docs/model.md): 'auto' keeps causal-only batches on SDPA's causal kernels and runs a
    rule through FlexAttention block masks on a GPU (compiled once per shape; eagerly,
    said once, where torch.compile is unavailable) or, on the CPU, where FlexAttention
    has no backward, through SDPA's flash kernel one document or window band at a time;
    memory O(seq) either way. 'dense': a (batch, 1, seq, seq) boolean mask through SDPA,
    O(seq**2) memory, for comparison. Ring attention (a distributed.cp ring) applies each
    rule with its own block kernels whatever this says (a warning says so for 'dense')."""
    float8: bool = False
    """Run the Transformer blocks' linear layers (attention and dense or shared-expert
    feed-forward projections) as FP8 matmuls with dynamic tensorwise scaling, through
    torchao (the 'float8' extra); the weights, gradients and optimizer state stay fp32
    and the rest of the model (embedding, head, norms, router, routed experts) computes
    as before. Needs a CUDA GPU of compute capability 8.9 or newer (refused elsewhere),
    model dims and train.seq_len that are multiples of 16, a text model and no tensor
    parallelism. Pays off with train.compile = true. See docs/performance.md."""
    num_threads: int = 0
    """CPU intra-op threads for torch; 0 keeps torch's default; at most 65536."""
    allocator: str = "auto"
    """Host memory allocator: 'tcmalloc' or 'jemalloc' (the command restarts itself with
    the library preloaded; an error when it is not installed), 'glibc' (glibc malloc tuned
    to keep freed memory for reuse instead of returning it to the kernel), 'system' (as the
    process starts), or the path of an allocator library to preload. 'auto': tcmalloc when
    installed, else 'glibc' on glibc systems. The environment variable
    KEMPNERFORGE_ALLOCATOR, when set, takes precedence. See docs/performance.md."""
    loss_fn: str = "cross_entropy"
    """Training loss, by name."""
    z_loss_weight: float = 0.0
    """Weight of the output z-loss, mean(logsumexp(logits)^2); 0 disables it; at most 1000."""
    loss_chunk_tokens: int = 2048
    """Tokens per chunk of the fused output head + cross-entropy: the logits, loss and
    gradients of that many tokens at a time, so a micro-batch's whole (tokens, vocab) logits
    never exist. 0 computes the whole micro-batch's logits at once, as a plain head and loss
    would; both give the same loss and gradients. At most 2**31 - 1."""
    nan_consecutive_max: int = 5
    """After this many consecutive steps with a non-finite loss or gradient norm, roll back
    to the last complete checkpoint (or stop when nan_max_rollbacks is used up); at least 1."""
    nan_max_rollbacks: int = 3
    """Rollbacks allowed per run before a NaN streak stops it (exit code 3); 0 stops at once."""
    nan_rollback_lr_scale: float = 1.0
    """Multiply the learning rate by this after each rollback (e.g. 0.5); 1 keeps it.
    > 0 and at most 1."""
    spike_window: int = 128
    """Loss-spike rule: how many recent steps' losses (each attempt with a finite loss) the
    mean and standard deviation are taken over. A step whose loss is above that mean by more
    than spike_sigmas standard deviations is skipped like a non-finite one. 0 turns the
    rule off; 1 is refused (one loss has no standard deviation); at most 2**31 - 1."""
    spike_sigmas: float = 6.0
    """Loss-spike rule: how many standard deviations above the window's mean loss a step's
    loss must be to count as a spike; > 0 and at most 1e6."""
    spike_min_history: int = 0
    """Loss-spike rule: no step is judged a spike until the window holds this many losses,
    so a run shorter than this never skips one; 0 means half of spike_window (64 by
    default), otherwise 2 to spike_window."""
    attribute_faults: bool = True
    """Run a step whose loss or gradient norm is non-finite, or whose loss spikes, once more
    on the same weights and batches: a fault that repeats is the data's (its windows are
    recorded in <checkpoint dir>/bad_data.jsonl and never read again), one that does not is
    the machine's (the clean re-run's update is kept). False skips such a step at once.
    A good step pays only a copy of the random state. Replica groups ([fault_tolerance])
    skip such a step at once: their data moves with each quorum's commit."""
    max_hardware_faults: int = 3
    """With attribute_faults: after this many suspected hardware faults in one launch the
    run stops with exit code 76 (HARDWARE_FAULT) so the job can be moved to other nodes;
    0 never stops for them. At most 2**62 - 1."""
    hooks: list[str] = field(default_factory=list)
    """Training hooks by import path, 'package.module:ClassName', each built with no arguments."""
    phases: list[PhaseConfig] = field(default_factory=list)
    """[[train.phases]]: a schedule of mixture weights and LR scales by step, in order."""
    sample_prompt: str = "def "
    """At the end of a run, greedily continue this prompt and print it; empty disables it."""
    sample_tokens: int = 120
    """Number of tokens generated for the end-of-run sample; 0 to 2**31 - 1."""
    hang_timeout_s: float = 0.0
    """Hang watchdog, in seconds: a training step running longer than this writes every
    thread's stack to <run_dir>/hangs/ and ends the run with exit code 77 (requeue). 0
    derives the limit from measured times: 30 minutes for the first two steps, then 10
    times the slowest step so far, at least 5 minutes; evals and checkpoint saves and
    loads get limits of their own by the same rule (also when this is set). A negative
    value turns the watchdog off. At most 1e7."""

    def precision_on(self, device_type: str) -> str:
        """'bf16' or 'fp32': mixed_precision on a device of ``device_type`` ('cuda', 'cpu'),
        'auto' resolved."""
        if self.mixed_precision == "auto":
            return "bf16" if device_type == "cuda" else "fp32"
        return self.mixed_precision

    def __post_init__(self) -> None:
        if not RUN_NAME.fullmatch(self.name):
            raise ConfigError("train.name", self.name, RUN_NAME_RULE, "it names runs/<name>")
        for name in ("batch_size", "seq_len", "grad_accum_steps"):
            check_positive(f"train.{name}", getattr(self, name), MAX_SIZE)
        check_positive("train.max_steps", self.max_steps, MAX_STEPS)
        # A gradient norm above 1e6 means the run has diverged; 0 already turns clipping off.
        check_at_least("train.grad_clip_norm", self.grad_clip_norm, 0.0, 1e6)
        check_at_least("train.z_loss_weight", self.z_loss_weight, 0.0, MAX_LOSS_WEIGHT)
        check_at_least("train.loss_chunk_tokens", self.loss_chunk_tokens, 0, MAX_SIZE)
        check_at_least("train.global_batch_size", self.global_batch_size, 0, MAX_STEPS)
        check_in_range("train.seed", self.seed, 0, MAX_SEED)
        check_at_least("train.num_threads", self.num_threads, 0, MAX_THREADS)
        check_at_least("train.nan_consecutive_max", self.nan_consecutive_max, 1, MAX_STEPS)
        check_at_least("train.nan_max_rollbacks", self.nan_max_rollbacks, 0, MAX_STEPS)
        # A rollback follows a divergence: the learning rate may stay or drop, never grow.
        check_positive("train.nan_rollback_lr_scale", self.nan_rollback_lr_scale, 1.0)
        check_at_least("train.spike_window", self.spike_window, 0, MAX_SIZE)
        if self.spike_window == 1:  # one loss has no standard deviation
            raise ConfigError("train.spike_window", 1, "0 (off) or an integer >= 2")
        check_positive("train.spike_sigmas", self.spike_sigmas, 1e6)
        if self.spike_window and self.spike_min_history:
            check_in_range("train.spike_min_history", self.spike_min_history, 2, self.spike_window)
        check_at_least("train.spike_min_history", self.spike_min_history, 0)
        check_at_least("train.max_hardware_faults", self.max_hardware_faults, 0, MAX_STEPS)
        check_at_least("train.sample_tokens", self.sample_tokens, 0, MAX_SIZE)
        check_in_range("train.hang_timeout_s", self.hang_timeout_s, -1e7, MAX_HANG_TIMEOUT_S)
        check_choice("train.device", self.device, DEVICES)
        check_choice("train.mixed_precision", self.mixed_precision, PRECISIONS)
        check_choice("train.attention_kernel", self.attention_kernel, ATTENTION_KERNELS)
        if not self.allocator.startswith("/"):
            check_choice("train.allocator", self.allocator, ALLOCATORS)
        for i, phase in enumerate(self.phases):
            phase.check(f"train.phases[{i}]")
        for i, (before, after) in enumerate(zip(self.phases, self.phases[1:], strict=False)):
            if after.start_step <= before.start_step:
                raise ConfigError(
                    f"train.phases[{i + 1}].start_step",
                    after.start_step,
                    f"> train.phases[{i}].start_step = {before.start_step} (phases in order)",
                )
        for hook in self.hooks:
            module, _, attr = hook.partition(":")
            if not module or not attr:
                raise ConfigError("train.hooks", hook, "an import path 'package.module:ClassName'")
