"""Tensor-parallel collectives per block on this machine: plain TP (what pipeline stages
run) and sequence-parallel TP, counted over one forward and one backward of the debug
model's width on 2 gloo ranks, with the bytes each moves per rank and the time of a step.

Counts come from torch's CommDebugMode; the per-block figures are the difference between
the 2-layer and the 1-layer model. Run alone on the machine.

    python bench/tp_collectives.py
    python bench/tp_collectives.py --dim 256 --seq-len 256 --repeats 5
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from torch.distributed.tensor.debug import CommDebugMode  # noqa: E402

from kempnerforge.distributed.runtime import init_runtime  # noqa: E402
from kempnerforge.distributed.tensor_parallel import apply_tp  # noqa: E402
from tests.support.dist import run_distributed  # noqa: E402
from tests.support.parallel import build_parallel, job_config, lm_loss, token_batch  # noqa: E402


def _measure(rank: int, world_size: int, args: dict[str, int]) -> dict[str, Any]:
    tp = ["--distributed.tp=2", "--distributed.dp_shard=1", f"--model.dim={args['dim']}"]
    tp += [f"--model.max_seq_len={args['seq_len']}"]
    runtime = init_runtime(job_config(*tp).distributed, "cpu")
    mesh = runtime.device_mesh["tp"]
    results: dict[str, Any] = {}
    for sequence_parallel in (False, True):
        for n_layers in (1, 2):
            config = job_config(*tp, f"--model.n_layers={n_layers}")
            model = build_parallel(
                config,
                runtime,
                parallelize=lambda m, sp=sequence_parallel: apply_tp(m, mesh, sequence_parallel=sp),
            )
            batch = token_batch(0, 4, args["seq_len"], config.model.vocab_size)
            times = []
            for _ in range(args["repeats"]):
                start = time.perf_counter()
                with CommDebugMode() as forward:
                    loss = lm_loss(model(batch[0]), batch[1])
                with CommDebugMode() as backward:
                    loss.backward()
                times.append(time.perf_counter() - start)
                model.zero_grad()
            name = "sequence_parallel" if sequence_parallel else "plain"
            results[f"{name}/{n_layers}"] = {
                "forward": {str(k).split(".")[-1]: v for k, v in forward.get_comm_counts().items()},
                "backward": {
                    str(k).split(".")[-1]: v for k, v in backward.get_comm_counts().items()
                },
                "step_s": statistics.median(times),
            }
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dim", type=int, default=256)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    settings = {"dim": args.dim, "seq_len": args.seq_len, "repeats": args.repeats}
    results = run_distributed(_measure, 2, settings, timeout_s=600)[0]
    for name in ("plain", "sequence_parallel"):
        one, two = results[f"{name}/1"], results[f"{name}/2"]
        for phase in ("forward", "backward"):
            per_block = {k: two[phase][k] - one[phase].get(k, 0) for k in two[phase]}
            print(f"{name:18s} {phase:8s} 1 layer {one[phase]}  per block {per_block}")
        print(f"{name:18s} step (2 layers, batch 4) {two['step_s'] * 1e3:.1f} ms (median)")


if __name__ == "__main__":
    main()
