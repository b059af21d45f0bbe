"""Fault-tolerant replica groups on torchft: the quorum of each step, the commit, the live
state a rejoining group takes from a peer, and which group writes the job's checkpoints.

With [fault_tolerance] the train command makes this launch's ReplicaGroup, installs it into
the built session (ReplicaGroup.install: the step body, the batch stream, the cross-group
reductions, a hook and the checkpointer's saver rule are replaced there, the one change a
session gets after its build), joins the first quorum in place of the usual resume
(ReplicaGroup.join) and trains with the groups (ReplicaGroup.train), so the loop and the
step bodies hold no branch for it. torchft is imported only on that path.

Each step attempt: the group joins a quorum (torchft Manager.start_quorum, synchronous);
a group behind the quorum's newest step takes a peer's live state first. The quorum's n
participants split the step's slots (data/sampling/step_slots.py); token count, loss and gradients
are summed over the groups; then should_commit: True and the loop steps the optimizer as
usual; False (a group died mid-step, a collective timed out) and the gradients are dropped
and the same data step is attempted again with the next quorum.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from kempnerforge.checkpoint.manager import CheckpointManager
from kempnerforge.config.fault_tolerance import FaultToleranceConfig
from kempnerforge.core.logging import get_logger
from kempnerforge.training.families import StepFn
from kempnerforge.training.hooks import StepContext, TrainingHook
from kempnerforge.training.loop import run_training_loop
from kempnerforge.training.replicas.batches import ReplicaBatches, SamplerPosition
from kempnerforge.training.replicas.manager import TorchftReplicas, make_manager
from kempnerforge.training.replicas.participation import Participation
from kempnerforge.training.replicas.quorum_loss import (
    LastCommit,
    QuorumLost,
    stop_after_quorum_loss,
)
from kempnerforge.training.resume_plan import ResumePlan, apply_resume
from kempnerforge.training.session import StepResult, TrainingSession
from kempnerforge.training.state import capture_train_state, restore_train_state

logger = get_logger(__name__)


class ReplicaRejoined(Exception):
    """A running group took its peers' live state: the loop restarts at their position.

    Raised right after the quorum in which the group healed, before the step's forward,
    and caught by ReplicaGroup.train, which re-enters the loop at ``position``; the
    step's attempt then goes on in the same quorum, so the peers wait only for that.
    """

    def __init__(self, position: tuple[int, int]) -> None:
        super().__init__(f"continuing at step {position[0]} with the replica groups' state")
        self.position = position


def checkpointer_kind(ft: FaultToleranceConfig) -> type[CheckpointManager]:
    """The checkpoint manager class of a run: the replica groups' with [fault_tolerance]."""
    return GroupCheckpointManager if ft.enabled else CheckpointManager


class GroupCheckpointManager(CheckpointManager):
    """The job's checkpoints, written by one group per save: the one is_saver names.

    Every group decides alike from the same quorum, so exactly one writes each checkpoint,
    with its own process group as any run does; the others skip it (and its cleanup of
    interrupted saves and retention, which the writing group does).
    """

    is_saver: Callable[[], bool] = staticmethod(lambda: True)

    def should_save(self, step: int, max_steps: int) -> bool:
        return super().should_save(step, max_steps) and self.is_saver()

    def save(self, step: int, **kwargs: Any) -> str:
        if not self.is_saver():
            logger.info("step %d: checkpoint written by another replica group", step)
            return self.location(f"step_{step}")
        return super().save(step, **kwargs)


class ReplicaGroup(TrainingHook):
    """This launch's membership in the job's replica groups (one object per process).

    Made from a built session, which it changes only in install. It is also a hook: after
    each optimizer step it records the loop's step and tokens seen, which the live state it
    serves to a rejoining peer carries.
    """

    def __init__(self, session: TrainingSession) -> None:
        config = session.config
        ft = config.fault_tolerance
        self.session = session
        self.group_id = ft.group_id()
        self._loop_position = (0, 0)
        """(step, tokens_seen) of the state this group holds: the loop's after its last
        optimizer step, or a peer's just taken."""
        self._moved = False  # a peer's state was taken mid-run: the loop must follow
        self._healed = False
        self._running = False
        self._quorum_open = False
        self._last_rank: int | None = None  # in the quorum of the last committed step
        self._on_disk_step = -1  # the newest step this group knows is on disk
        self.batches = ReplicaBatches(
            session.data,
            ft.num_replica_groups * config.train.grad_accum_steps,
            config.train.batch_size,
            session.batches.source,
        )
        self.manager = make_manager(
            ft, session.runtime, self.group_id, self._load_live, self._live_state
        )
        self.participation = Participation(
            ft.num_replica_groups, ft.participation_window, ft.participation_warn_below
        )
        self._missed = 0  # steps a heal mid-run skipped: committed without this group
        self.replicas = TorchftReplicas(self.manager, ft.num_replica_groups, self.participation)

    def install(self) -> None:
        """Make the built session this group's, before the resume: the one change a session
        gets after its build.

        Its loader stands for the sampler's position (SamplerPosition), its batches are the
        slots of each step's quorum (ReplicaBatches), its reductions span the quorum's groups
        (TorchftReplicas), its step body is attempted until every group commits it
        (ReplicaStep), this group hears of every step as a hook, and a checkpoint is written
        by the group is_saver names.
        """
        session = self.session
        session.data.dataloader = SamplerPosition(session.data.sampler)  # type: ignore[assignment]
        session.use_batches(self.batches)
        session.use_replicas(self.replicas)
        session.step_fn = ReplicaStep(session.step_fn, self)
        session.hooks.add(self)
        if isinstance(session.checkpointer, GroupCheckpointManager):
            session.checkpointer.is_saver = self.is_saver

    # --- The quorum and the commit ------------------------------------------------------

    def begin_attempt(self) -> list[int]:
        """Join the step's quorum (unless start-up already did) and take this group's slots.

        A running group that took a peer's live state in this quorum raises
        ReplicaRejoined: the loop re-enters at the peers' step and continues this attempt
        (the quorum stays open), so the loop's counters always match the state.
        """
        if not self._quorum_open:
            try:
                self.manager.start_quorum()
            except Exception as error:  # the lighthouse's answer never came
                raise QuorumLost(self.group_id, self._loop_position[0] + 1, error) from error
            if self._moved:
                self._moved, self._quorum_open = False, True
                step = self._loop_position[0]
                logger.warning(
                    "replica group %d fell behind its peers and took their live state: "
                    "continuing at step %d",
                    self.group_id,
                    step,
                )
                self.session.tracker.log_event(step, "replica_rejoined", group=self.group_id)
                self.participation.healed(self._missed)
                raise ReplicaRejoined(self._loop_position)
        self._quorum_open = False
        rank = self.manager.participating_rank()
        participants = self.manager.num_participants()
        if rank is None:
            raise RuntimeError(
                f"replica group {self.group_id} is not a participant of its quorum "
                f"({participants} participants)"
            )
        return self.batches.assign(participants, rank)

    def commit(self, step: int) -> bool:
        """Ask every group whether the attempt may count; on yes, consume its data step.

        Logs a ``replica_step`` event (data step, participants, this group's rank and
        slots) or a ``replica_step_discarded`` one.
        """
        manager, tracker = self.manager, self.session.tracker
        participants, rank = manager.num_participants(), manager.participating_rank()
        if manager.should_commit():
            self._last_rank = rank
            data_step = self.batches.commit()
            change = self.participation.record(participants)
            if change is not None:
                logger.warning("step %d: %s", step, change)
            tracker.log_event(
                step,
                "replica_step",
                group=self.group_id,
                data_step=data_step,
                participants=participants,
                rank=rank,
                slots=list(self.batches.assignment),
            )
            return True
        error = manager.errored()
        tracker.log_event(
            step,
            "replica_step_discarded",
            group=self.group_id,
            data_step=self.batches.data_step,
            participants=participants,
            error=str(error.original_exception) if error is not None else "",
        )
        logger.warning(
            "step %d: replica group %d discards the attempt (%s); redoing it with the groups "
            "still alive",
            step,
            self.group_id,
            error.original_exception if error is not None else "a peer did not commit",
        )
        return False

    def is_saver(self) -> bool:
        """Whether this group writes the checkpoint now: participant 0 of the quorum of the
        last committed step (kept, not asked of torchft, which raises once a quorum failed)."""
        return self._last_rank == 0

    def last_commit(self) -> LastCommit:
        """This group's last committed step, for stop_after_quorum_loss."""
        step, tokens_seen = self._loop_position
        return LastCommit(step, tokens_seen, self._last_rank == 0, self._on_disk_step == step)

    # --- Start-up -----------------------------------------------------------------------

    def join(self, plan: ResumePlan | None) -> tuple[int, int]:
        """Join the first quorum; take the peers' live state or, when no peer is ahead of
        a fresh process (the whole job is starting), resume from disk as any run does.

        The first quorum is the first step's: a group that heals here trains that step
        with the others. Returns the loop's (step, tokens_seen).
        """
        self.manager.start_quorum()
        self._quorum_open = True
        if self._healed:
            step, tokens_seen = self._loop_position
            logger.info(
                "replica group %d joined at step %d with a peer's live state (not read from disk)",
                self.group_id,
                step,
            )
            # The loop starts at the peers' step: the steps before it were not trained here.
            self.session.tracker.log_event(step, "replica_joined", group=self.group_id)
        else:
            step, tokens_seen = apply_resume(self.session, plan)
            self._loop_position = (step, tokens_seen)
            self._on_disk_step = step if plan is not None else -1
            data_step = self.batches.data_step
            self.manager.load_state_dict({"step": data_step, "batches_committed": 0})
            logger.info(
                "replica group %d starts at step %d (data step %d) with %d group(s) in its "
                "first quorum",
                self.group_id,
                step,
                data_step,
                self.manager.num_participants(),
            )
        self._last_rank = self.manager.participating_rank()
        self._running = True
        return step, tokens_seen

    # --- Training -----------------------------------------------------------------------

    def train(self, step: int, tokens_seen: int) -> tuple[int, int]:
        """run_training_loop from ``step``, re-entered at the replica groups' position
        whenever this group takes their live state mid-run (ReplicaRejoined). A lost quorum
        (QuorumLost) ends it as a stop request does, after stop_after_quorum_loss. Returns
        the loop's final (step, tokens_seen)."""
        while True:
            try:
                return run_training_loop(self.session, step=step, tokens_seen=tokens_seen)
            except ReplicaRejoined as moved:
                step, tokens_seen = moved.position
            except QuorumLost as lost:
                position = stop_after_quorum_loss(self.session, lost, self.last_commit())
                self.manager.shutdown(wait=False)
                return position

    # --- The live state -----------------------------------------------------------------

    def _live_state(self) -> dict[str, Any]:
        """What a rejoining group needs to continue as this one: this rank's shards of the
        model and optimizer, the schedule, data position, NaN counters, phases, RNG and
        the loop's step and tokens seen. Plain tensors and containers only."""
        from kempnerforge.distributed.live_state import model_state, optimizer_state

        session = self.session
        step, tokens_seen = self._loop_position
        train_state = capture_train_state(
            session.data,
            session.nan_detector,
            step,
            tokens_seen,
            {"phases": session.phases.state_dict()},
        )
        return {
            "model": model_state(session.model),
            "optimizer": optimizer_state(session.optimizer),
            "scheduler": session.scheduler.state_dict(),
            "train_state": train_state,
        }

    def _load_live(self, state: dict[str, Any]) -> None:
        """Take a peer's _live_state: at start-up the loop starts from it; mid-run (the
        group fell behind) the loop re-enters at it (begin_attempt)."""
        from kempnerforge.distributed.live_state import load_model_state, load_optimizer_state

        session = self.session
        load_model_state(session.model, state["model"])
        load_optimizer_state(session.optimizer, state["optimizer"])
        session.scheduler.load_state_dict(state["scheduler"])
        behind_at = self._loop_position[0]
        self._loop_position = restore_train_state(session, state["train_state"])
        self._missed = self._loop_position[0] - behind_at
        self._moved = self._running
        self._healed = True

    # --- Hook events --------------------------------------------------------------------

    def on_step_end(self, ctx: StepContext) -> None:
        self._loop_position = (ctx.step, ctx.tokens_seen)

    def on_checkpoint_save(self, step: int, path: str) -> None:
        self._on_disk_step = step  # committed, by this group (the others skip the save)

    def on_train_end(self, step: int, tokens_seen: int) -> None:
        self.manager.shutdown(wait=False)


class ReplicaStep:
    """The family's step body, attempted until every group of its quorum commits it."""

    def __init__(self, inner: StepFn, group: ReplicaGroup):
        self.inner = inner
        self.group = group
        self.__name__ = getattr(inner, "__name__", "step")

    def __call__(self, session: TrainingSession, step: int) -> StepResult:
        while True:
            self.group.begin_attempt()
            result = self.inner(session, step)
            if self.group.commit(step + 1):
                return result
            session.optimizer.zero_grad(set_to_none=True)
            session.batches.take_wait_s()
