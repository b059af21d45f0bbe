"""The summary of a bench/gpu/suite.py run: the best configuration of each shape, the ratio
to the hand-written loop, the FP8 gains, every check's verdict and the goals met."""

from __future__ import annotations

from typing import Any

MFU_GOAL = 0.55
"""The MFU each of the 1B preset and the 8B shape should reach on one H200."""

RATIO_GOAL = 1.0
"""kempnerforge's tokens/s over the hand-written loop's at the 1B shape."""


def passed(rows: dict[str, Any], prefix: str) -> dict[str, dict[str, Any]]:
    """The rows whose name starts with ``prefix`` and that finished."""
    return {
        name: row
        for name, row in rows.items()
        if name.startswith(prefix) and row.get("status") == "pass"
    }


def best(rows: dict[str, dict[str, Any]]) -> tuple[str, dict[str, Any]] | None:
    """The row with the most tokens/s, by name."""
    if not rows:
        return None
    return max(rows.items(), key=lambda item: item[1].get("tokens_per_sec", 0.0))


def gain(faster: dict[str, Any] | None, slower: dict[str, Any] | None) -> float | None:
    """Tokens/s of ``faster`` over ``slower``; None unless both finished."""
    if not faster or not slower or faster.get("status") != "pass":
        return None
    if slower.get("status") != "pass" or not slower.get("tokens_per_sec"):
        return None
    return faster["tokens_per_sec"] / slower["tokens_per_sec"]


def summarize(results: dict[str, Any]) -> dict[str, Any]:
    """The figures docs/performance.md's GPU tables quote, from a run's results so far."""
    mfu, hand = results.get("mfu", {}), results.get("hand_written", {})
    fp8 = results.get("float8", {})
    summary: dict[str, Any] = {}
    for shape in ("1b", "8b"):
        top = best(passed(mfu, f"{shape}_"))
        summary[f"best_{shape}"] = (
            None
            if top is None
            else {
                "name": top[0],
                "mfu": top[1].get("mfu"),
                "tokens_per_sec": top[1]["tokens_per_sec"],
                "peak_memory_gib": top[1].get("peak_memory_gib"),
            }
        )
    hand_best = best(passed(hand, "1b_"))
    ratio = gain(mfu.get("1b_compiled"), hand_best[1] if hand_best else None)
    summary["kempnerforge_over_hand_written_1b"] = ratio
    summary["hand_written_best"] = hand_best[0] if hand_best else None
    summary["float8_gain_1b"] = gain(fp8.get("1b_compiled_fp8"), mfu.get("1b_compiled"))
    summary["float8_gain_8b"] = gain(
        fp8.get("8b_compiled_selective_ac_fp8"), mfu.get("8b_compiled_selective_ac")
    )
    summary["checks"] = {name: row.get("status") for name, row in results.get("checks", {}).items()}
    mfus = {shape: (summary[f"best_{shape}"] or {}).get("mfu") for shape in ("1b", "8b")}
    summary["goals"] = {
        f"mfu_{shape}_at_least_{MFU_GOAL}": None if value is None else value >= MFU_GOAL
        for shape, value in mfus.items()
    }
    summary["goals"][f"ratio_at_least_{RATIO_GOAL}"] = (
        None if ratio is None else ratio >= RATIO_GOAL
    )
    return summary
