"""Run the layout sweep: every layout of 2 to 4 processes that validation accepts, for each
config in variants.py, trained against one process (`make test-layouts`).

Writes each variant's check-parallel output to --logs, and, for each variant whose
accepted layouts all passed, those layouts to tests/layouts/checked.txt, the record
test_layout_sweep.py holds validation to. Exits 1 when any accepted layout fails.
"""

from __future__ import annotations

import argparse
import os
import pathlib
import subprocess
import sys

from tests.layouts.variants import VARIANTS, sweep_argv

RECORD = pathlib.Path(__file__).with_name("checked.txt")
RECORD_HEADER = (
    "# Layouts that trained as one process in the sweep (make test-layouts), one per line:\n"
    "# <variant> <layout>. test_layout_sweep.py fails when validation accepts any other.\n"
)


def passed_layouts(output: str) -> list[str]:
    """The layouts of a check-parallel table whose row ends in PASS."""
    return [line.split()[0] for line in output.splitlines() if line.endswith(" PASS")]


def run_variant(variant: str, logs: pathlib.Path) -> tuple[int, list[str]]:
    """Sweep one variant; (check-parallel's exit code, the layouts that passed)."""
    command = [sys.executable, "-m", "kempnerforge", "check-parallel", *sweep_argv(variant)]
    env = {key: value for key, value in os.environ.items() if key != "OMP_NUM_THREADS"}
    proc = subprocess.run(command, capture_output=True, text=True, env=env, check=False)
    (logs / f"{variant}.log").write_text(proc.stdout + "\n--- stderr ---\n" + proc.stderr)
    summary = [line for line in proc.stdout.splitlines() if line.startswith("sweep:")]
    print(f"{variant}: exit {proc.returncode}; {' '.join(summary) or 'no summary'}", flush=True)
    return proc.returncode, passed_layouts(proc.stdout)


def write_record(results: dict[str, list[str]]) -> None:
    """Replace the record's lines of each variant in ``results`` by its passed layouts,
    keeping the other variants' lines, in the order of VARIANTS."""
    record = {variant: [] for variant in VARIANTS}
    if RECORD.exists():
        for line in RECORD.read_text().splitlines():
            if line.strip() and not line.startswith("#"):
                variant, layout = line.split()
                record.setdefault(variant, []).append(layout)
    record.update(results)
    lines = [f"{v} {layout}\n" for v in VARIANTS for layout in record.get(v, [])]
    RECORD.write_text(RECORD_HEADER + "".join(lines))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--logs", default="runs/layout-sweep", help="where each log goes")
    parser.add_argument("variants", nargs="*", default=list(VARIANTS), help="default: all")
    args = parser.parse_args()
    unknown = sorted(set(args.variants) - set(VARIANTS))
    if unknown:
        parser.error(f"unknown variant(s) {unknown}; choose from {list(VARIANTS)}")
    logs = pathlib.Path(args.logs)
    logs.mkdir(parents=True, exist_ok=True)
    failed = []
    for variant in args.variants:
        code, layouts = run_variant(variant, logs)
        if code:
            failed.append(variant)
        else:  # recorded only when every layout it accepts passed, and at once
            write_record({variant: layouts})
    print(f"failed: {', '.join(failed)}" if failed else f"all passed; recorded in {RECORD}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
