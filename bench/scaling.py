"""What one rank of a 1,024-rank job pays, computed from the code's own counters.

For the 8b (8.0B) and 70b (70.6B) presets on 1,024 ranks, HSDP x TP (dp_replicate 16 x
dp_shard 8 x tp 8) and with pipeline stages (pp 4 x dp_replicate 4 x dp_shard 8 x tp 8),
prints a Markdown table of one rank's start-up, resume, host memory and per-step
figures, each with where it comes from:

- simulated: the rank's real start-up, build and training loop among 1,023 fake peers
  (tests/support/world_sim.py: torch's fake process group), counting the process groups it
  creates and joins and every collective of a step, on a 2- and a 4-block model laid out
  as the job is (so the per-block count is their difference); the files a rank opens to
  plan a resume of a checkpoint saved by 1,024 ranks (tests/support/fake_world.py);
- computed: the model built and sharded by the real code on the meta device for each
  preset and layout (build_rank_on_meta), so its shard sizes are the code's own;
- measured: the host memory (tracemalloc) and time of opening a 1e13-token corpus of
  1,000 sparse shards and drawing the first batches of data-parallel rank 127 of 128;
- estimated: collective payloads from those shard sizes and the activation shapes.

    python bench/scaling.py [--shards 1000] [--tokens 1e13]

Takes about a minute (each simulation is a fresh process); needs a filesystem with holes.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
import tracemalloc
from collections import Counter
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from kempnerforge.config.loader import load_config  # noqa: E402
from tests.support.world_sim import run_shard_rank, run_simulation  # noqa: E402

WORLD = 1024
SEQ_LEN = 4096
LAYOUTS = {"HSDP x TP": (1, 16, 8, 8), "PP x HSDP x TP": (4, 4, 8, 8)}
"""Name -> (pp, dp_replicate, dp_shard, tp)."""
PRESETS = {"8B": "configs/model/8b.toml", "70B": "configs/model/70b.toml"}
TINY = [
    "--model.dim=64",
    "--model.n_heads=8",
    "--model.n_kv_heads=8",
    "--model.vocab_size=512",
    "--model.multiple_of=16",
    "--model.max_seq_len=64",
    "--train.seq_len=32",
    "--train.batch_size=1",
    "--checkpoint.interval=0",
    "--eval.interval=0",
    "--train.mixed_precision=bf16",
]


def layout_overrides(layout: tuple[int, int, int, int]) -> list[str]:
    pp, replicate, shard, tp = layout
    out = [
        f"--distributed.pp={pp}",
        f"--distributed.dp_replicate={replicate}",
        f"--distributed.dp_shard={shard}",
        f"--distributed.tp={tp}",
    ]
    if pp > 1:
        out += ["--data.document_masking=false", f"--train.grad_accum_steps={2 * pp}"]
    return out


def per_step_collectives(workdir: str) -> dict[str, object]:
    """Groups and collectives of rank 1,021 in the HSDP x TP layout, simulated."""
    layout = layout_overrides(LAYOUTS["HSDP x TP"])
    reports = {
        layers: run_simulation(
            [*TINY, f"--model.n_layers={layers}", *layout],
            WORLD - 3,
            WORLD,
            2,
            f"{workdir}/{layers}",
        )
        for layers in (2, 4)
    }
    counts = {}
    for layers, report in reports.items():
        step = report.steps[-1]
        counts[layers] = Counter(report.group_roles.get(c.group, "?") for c in step)
    per_block = {role: (counts[4][role] - counts[2][role]) / 2 for role in counts[4]}
    fixed = {role: counts[2][role] - 2 * per_block[role] for role in counts[2]}
    base = reports[2]
    return {
        "groups_joined": base.groups_joined,
        "world_groups": base.world_groups,
        "new_group_calls": base.new_group_calls,
        "per_block": per_block,
        "fixed": fixed,
        "world_per_step": base.per_step_world_collectives()[-1],
    }


def resume_file_opens() -> int:
    """Files a middle rank of 1,024 opens to judge a checkpoint it resumes from, simulated."""
    import pytest

    from kempnerforge.checkpoint.integrity import share_problems
    from tests.support.fake_world import count_file_access, write_fake_checkpoint

    with tempfile.TemporaryDirectory() as root, pytest.MonkeyPatch.context() as patch:
        path = write_fake_checkpoint(Path(root), 10, WORLD)
        with count_file_access(patch, path) as access:
            assert share_problems(path, 517, WORLD) == []
        return sum(access.opens.values())


def data_index_memory(root: Path, num_tokens: int, num_shards: int) -> tuple[float, float]:
    """(peak MiB, seconds) of opening a sharded corpus and drawing dp rank 127's first
    batches of 8 windows, measured with tracemalloc."""
    from kempnerforge.data.dataset import MemoryMappedDataset
    from kempnerforge.data.sampling.sampler import ShardedSampler

    per_shard = num_tokens // num_shards
    for index in range(num_shards):
        shard = root / f"shard-{index:05d}-of-{num_shards:05d}"
        shard.mkdir(parents=True)
        with open(shard / "tokens.bin", "wb") as f:
            f.truncate(per_shard * 4)
        meta = {
            "format_version": 1, "dtype": "uint32", "vocab_size": 128256,
            "num_tokens": per_shard, "num_documents": 1, "tokenizer": "bpe", "eos_id": 1,
            "bos_id": 0, "bos_per_document": False, "content_sha256": "-", "sources": 1,
            "max_token_id": 0,
        }  # fmt: skip
        (shard / "meta.json").write_text(json.dumps(meta))
    tracemalloc.start()
    started = time.perf_counter()
    dataset = MemoryMappedDataset(str(root), SEQ_LEN, model_vocab_size=128256)
    sampler = ShardedSampler(len(dataset), dp_rank=127, dp_size=128, seed=0)
    iterator = iter(sampler)
    for _ in range(4 * 8):
        dataset[next(iterator)]
    seconds = time.perf_counter() - started
    peak = tracemalloc.get_traced_memory()[1] / 2**20
    tracemalloc.stop()
    return peak, seconds


def gib(num_bytes: float) -> str:
    return f"{num_bytes / 2**30:.2f} GiB"


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--tokens", type=float, default=1e13)
    parser.add_argument("--shards", type=int, default=1000)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        steps = per_step_collectives(tmp)
        data_peak, data_s = data_index_memory(Path(tmp) / "corpus", int(args.tokens), args.shards)
    opens = resume_file_opens()
    shards = {
        (preset, name): run_shard_rank(layout_overrides(layout), rank, WORLD, path)
        for preset, path in PRESETS.items()
        for name, layout in LAYOUTS.items()
        for rank in [WORLD - 1]  # the last pipeline stage holds the head
    }
    columns = [(preset, name) for preset in PRESETS for name in LAYOUTS]
    models = {preset: load_config(path).model for preset, path in PRESETS.items()}

    def local(column: tuple[str, str]) -> int:
        return shards[column].num_local_elements

    def dp_params(column: tuple[str, str]) -> int:
        """Parameters of this rank's FSDP units, whole (its shards times dp_shard)."""
        return local(column) * _layout_of(column)[2]

    def layers_of(column: tuple[str, str], model) -> int:
        return model.n_layers // _layout_of(column)[0]

    print("| per rank, 1,024 ranks | " + " | ".join(f"{p}, {n}" for p, n in columns) + " | how |")
    print("| --- " * (len(columns) + 2) + "|")

    def row(label: str, values: list[str], how: str) -> None:
        print(f"| {label} | " + " | ".join(values) + f" | {how} |")

    same = len(columns)
    row(
        "process groups joined (world-wide)",
        [f"{steps['groups_joined']} ({steps['world_groups']})"] * same,
        "simulated (HSDP x TP; PP's `pp` group replaces the size-1 one)",
    )
    row(
        "`new_group` calls at start-up, CPU (gloo)",
        [str(steps["new_group_calls"])] * same,
        "simulated; with NCCL the mesh splits one group per dimension",
    )
    row("files opened to judge a resume", [str(opens)] * same, "simulated (rank 517)")
    row(
        "model build: shards + one draw tile",
        [
            gib(4 * (shards[c].num_local_elements + shards[c].largest_tile_elements))
            for c in columns
        ],  # fmt: skip
        "computed: fp32 shards of the real build on meta (last rank)",
    )
    row(
        "resume: bytes read (model + AdamW state)",
        [gib(12 * shards[c].num_local_elements) for c in columns],
        "computed: 3 fp32 values per parameter of the rank's shards",
    )
    row(
        f"data index: {args.tokens:.0e} tokens, {args.shards} shards",
        [f"{data_peak:.2f} MiB, {data_s:.2f} s"] * same,
        "measured (tracemalloc, open + 4 batches of 8 windows)",
    )
    fixed, per_block = steps["fixed"], steps["per_block"]
    for role in ("dp_shard", "tp", "dp_replicate", "dp", "world"):
        values = [
            f"{fixed.get(role, 0) + models[p].n_layers * per_block.get(role, 0):.0f}"
            if name == "HSDP x TP"
            else "-"
            for p, name in columns
        ]
        row(f"collectives per step on `{role}`", values, "simulated, one micro-batch")
    row(
        "world-wide collectives per step",
        [str(steps["world_per_step"]) if n == "HSDP x TP" else "1" for _, n in columns],
        "simulated (the vote; PP: the same finish_step, read from the code)",
    )
    # Payloads, estimated from the computed shards: FSDP gathers bf16 parameters in the
    # forward and again in the backward, reduce-scatters fp32 gradients and all-reduces the
    # fp32 shard over the replicas; sequence-parallel TP moves four b x s x d bf16
    # activations per block forward and four backward, and the vocabulary-parallel loss
    # all-reduces three fp32 per token (row maximum, sum of exponentials, target logit).
    for label, volume in (
        ("`dp_shard` bytes per micro-batch (all-gathers in)", lambda c, m: 2 * 2 * dp_params(c)),
        ("`dp_shard` bytes per step (gradient reduce-scatter in)", lambda c, m: 4 * dp_params(c)),
        ("`dp_replicate` bytes per step (all-reduce)", lambda c, m: 4 * local(c)),
        (
            "`tp` bytes per micro-batch (activations, loss)",
            lambda c, m: 2 * SEQ_LEN * 8 * m.dim * layers_of(c, m) + 12 * SEQ_LEN,
        ),
    ):
        row(label, [gib(volume(c, models[c[0]])) for c in columns], "estimated from the shards")


def _layout_of(column: tuple[str, str]) -> tuple[int, int, int, int]:
    return LAYOUTS[column[1]]


if __name__ == "__main__":
    main()
