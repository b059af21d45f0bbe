"""The learning rate in force: one rule for every place that sets it.

An optimizer group's LR is its configured peak (``initial_lr``) times the NaN-rollback
scale, times the schedule's factor at the current step, times the scale of the phase in
force. The scheduler's ``step`` applies the first three; every other writer (a phase
firing, a rollback, a resume with a new schedule or a new peak) goes through
``refresh_learning_rates`` so that no path forgets a factor.
"""

from __future__ import annotations

from kempnerforge.training.session import TrainingSession


def refresh_learning_rates(session: TrainingSession) -> None:
    """Rewrite the scheduler's base LRs and every group's LR from what is in force now.

    The scheduler's own values (``base_lrs``, ``get_last_lr()``) leave the phase scale
    out, so its state_dict and a later ``scheduler.step()`` never compound it; the group
    LR the optimizer uses includes it.
    """
    scheduler, groups = session.scheduler, session.optimizer.param_groups
    rollback_scale = session.nan_detector.lr_scale
    scheduler.base_lrs = [group["initial_lr"] * rollback_scale for group in groups]
    scheduled = [
        base * factor(scheduler.last_epoch)
        for base, factor in zip(scheduler.base_lrs, scheduler.lr_lambdas, strict=True)
    ]
    scheduler._last_lr = scheduled
    for group, lr in zip(groups, scheduled, strict=True):
        group["lr"] = lr * session.phases.lr_scale
