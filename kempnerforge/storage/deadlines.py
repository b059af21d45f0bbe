"""Deadlines for store calls: every call to an object store ends by one, whatever the store
does (stall, trickle, reset, answer 503), and a call past it leaves no thread that keeps the
process from exiting.

An asynchronous fsspec client (s3fs, gcsfs, adlfs, HTTP) sends its requests from fsspec's
event loop: each call made through ``bounded`` gets the time left as fsspec's ``timeout``,
so at the deadline the call is cancelled on the loop, its connection closed and its
retries dropped: nothing it would have sent later is sent. A synchronous client cannot be
cancelled, so its call runs in a daemon thread that the caller stops waiting for at the
deadline (the call may still finish there). ``run_parallel`` runs a batch of calls on
daemon threads of its own under one deadline.
"""

from __future__ import annotations

import inspect
import threading
import time
from collections.abc import Callable, Iterable
from typing import Any, TypeVar

T = TypeVar("T")
_END = object()


class DeadlinePassed(TimeoutError):
    """A store call, or a batch of them, ran past its Deadline."""

    def __init__(self, deadline: Deadline, unfinished: int = 0, total: int = 0) -> None:
        self.deadline = deadline
        self.unfinished = unfinished
        self.total = total
        super().__init__(f"took longer than {deadline.describe()}")


class Deadline:
    """A moment ``seconds`` from now by which store calls must end; ``setting`` names what
    sets the limit (a config field), for the error that says it passed."""

    def __init__(self, seconds: float, setting: str) -> None:
        self.seconds = seconds
        self.setting = setting
        self.at = time.monotonic() + seconds

    def remaining(self) -> float:
        """Seconds left, 0 once it has passed."""
        return max(0.0, self.at - time.monotonic())

    def passed(self) -> bool:
        return time.monotonic() >= self.at

    def check(self) -> float:
        """The seconds left; DeadlinePassed when none are."""
        left = self.at - time.monotonic()
        if left <= 0:
            raise DeadlinePassed(self)
        return left

    def describe(self) -> str:
        return f"{self.setting} = {self.seconds:g} s"


def is_async(fs: Any) -> bool:
    """Whether ``fs`` is an asynchronous fsspec filesystem (its calls can be cancelled)."""
    return bool(getattr(fs, "async_impl", False))


class _Bounded:
    """``fs`` whose blocking calls each get the time left before ``deadline`` as fsspec's
    ``timeout`` (a method that fsspec's sync_wrapper made from a coroutine runs it on the
    event loop under that timeout); everything else passes through."""

    def __init__(self, fs: Any, deadline: Deadline) -> None:
        self._fs = fs
        self._deadline = deadline

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self._fs, name)
        if not inspect.iscoroutinefunction(getattr(attr, "__wrapped__", None)):
            return attr

        def call(*args: Any, **kwargs: Any) -> Any:
            return attr(*args, timeout=self._deadline.check(), **kwargs)

        return call


def call_by(deadline: Deadline, fs: Any, action: Callable[[Any], T]) -> T:
    """``action(fs)``, ended by ``deadline``: cancelled there for an asynchronous client,
    abandoned (in a daemon thread) for a synchronous one; DeadlinePassed when it passed."""
    if is_async(fs):
        return action(_Bounded(fs, deadline))
    outcome: list[Any] = []
    done = threading.Event()

    def run() -> None:
        try:
            outcome.append((True, action(fs)))
        except BaseException as exc:  # handed to the caller
            outcome.append((False, exc))
        done.set()

    left = deadline.check()  # no call starts past its deadline
    threading.Thread(target=run, name="kempnerforge-store-call", daemon=True).start()
    if not done.wait(left):
        raise DeadlinePassed(deadline)
    ok, value = outcome[0]
    if not ok:
        raise value
    return value


def run_parallel(
    action: Callable[[Any], None], items: Iterable[Any], *, workers: int, deadline: Deadline
) -> None:
    """``action(item)`` for every item, on up to ``workers`` daemon threads; returns when
    all are done.

    The first error is raised (the other threads take no new item), and DeadlinePassed
    (with the count of unfinished items) when the deadline passes first. An error raised
    at or past the deadline is the deadline passing too: a call's own bound is the same
    deadline, and which of the two a loaded machine notices first must not change what is
    reported. A thread still in a call then is left to it: its calls are bounded by the
    same deadline, and it takes no new item, so nothing starts after the batch has failed.
    """
    pending = list(items)
    if not pending:
        return
    lock = threading.Lock()
    queue = iter(pending)
    finished = threading.Event()
    state: dict[str, Any] = {"left": len(pending), "error": None, "late": False, "stop": False}

    def worker() -> None:
        while True:
            with lock:
                item = _END if state["stop"] else next(queue, _END)
            if item is _END:
                return
            try:
                action(item)
            except BaseException as exc:  # handed to the caller
                with lock:
                    if state["error"] is None:
                        state["error"], state["late"] = exc, deadline.passed()
                    state["stop"] = True
                finished.set()
                return
            with lock:
                state["left"] -= 1
                if state["left"] == 0:
                    finished.set()

    for _ in range(min(workers, len(pending))):
        threading.Thread(target=worker, name="kempnerforge-store", daemon=True).start()
    in_time = finished.wait(deadline.remaining())
    with lock:
        state["stop"] = True
        error, late, left = state["error"], state["late"], state["left"]
    if error is not None and not late:
        raise error
    if late or not in_time:
        raise DeadlinePassed(deadline, unfinished=left, total=len(pending)) from error
