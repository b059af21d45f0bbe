"""check-parallel's pure parts: layouts, batch split, metrics rows, comparison, table."""

from __future__ import annotations

import json
import sys

import pytest

from kempnerforge.commands.check_parallel import main as check_parallel
from kempnerforge.core.errors import ConfigError
from kempnerforge.launch import parallel_check as pc


def test_parse_layout_defaults_unnamed_degrees_to_one():
    layout = pc.parse_layout("dp_shard=2")
    assert (layout.pp, layout.dp_replicate, layout.dp_shard, layout.tp) == (1, 1, 2, 1)
    assert layout.world_size == 2 and layout.dp == 2 and layout.schedule == ""


def test_parse_layout_multiplies_degrees_and_maps_the_schedule():
    layout = pc.parse_layout("pp=2, schedule=gpipe,dp_replicate=2,dp_shard=2,tp=2")
    assert layout.world_size == 16 and layout.dp == 4
    assert layout.overrides() == [
        "--distributed.pp=2",
        "--distributed.dp_replicate=2",
        "--distributed.dp_shard=2",
        "--distributed.cp=1",
        "--distributed.tp=2",
        "--distributed.ep=1",
        "--distributed.pp_schedule=gpipe",
    ]


def test_parse_layout_takes_a_context_parallel_degree_that_shares_the_batch():
    layout = pc.parse_layout("cp=2,dp_shard=2")
    assert layout.world_size == 4 and layout.dp == 2 and layout.cp == 2
    assert "--distributed.cp=2" in layout.overrides()
    assert pc.per_rank_batch_size(8, layout) == 4


@pytest.mark.parametrize(
    ("text", "attention"),
    [
        ("cp=4,ring=4", ["--distributed.cp_attention=ring", "--distributed.cp_ulysses=1"]),
        ("cp=4,ring=2", ["--distributed.cp_attention=ring", "--distributed.cp_ulysses=2"]),
        ("cp=4,ring=1", ["--distributed.cp_attention=ulysses"]),
        ("cp=4", []),  # the config's own choice
    ],
)
def test_parse_layout_takes_a_ring_inside_the_context_parallel_ranks(text, attention):
    """ring splits cp, as ep splits dp_shard: the world is still the mesh's product."""
    layout = pc.parse_layout(text)
    assert layout.world_size == 4 and layout.dp == 1
    assert [a for a in layout.overrides() if "cp_" in a] == attention


def test_parse_layout_takes_an_expert_parallel_degree_inside_dp_shard():
    layout = pc.parse_layout("dp_shard=2,ep=2")
    assert layout.world_size == 2 and layout.dp == 2 and layout.ep == 2
    assert "--distributed.ep=2" in layout.overrides()


@pytest.mark.parametrize(
    ("text", "why"),
    [
        ("", "comma-separated"),
        ("dp_shard", "comma-separated"),
        ("dp_shard=", "comma-separated"),
        ("dp_shard=0", "dp_shard must be >= 1"),
        ("tp=-2", "tp must be >= 1"),
        ("tp=two", "tp must be >= 1"),
        ("tp=\u00b2", "tp must be >= 1"),
        ("fsdp=2", "unknown key 'fsdp'"),
        ("tp=2,tp=2", "'tp' is given twice"),
        ("pp=2,schedule=zigzag", "unknown schedule 'zigzag'"),
        ("schedule=1f1b", "schedule needs pp >= 2"),
        ("cp=4,ring=3", "ring must divide cp"),
        ("ring=2", "ring must divide cp"),
    ],
)
def test_parse_layout_refuses_bad_text_in_one_line(text, why):
    with pytest.raises(ConfigError) as info:
        pc.parse_layout(text)
    message = str(info.value)
    assert message.startswith(f"--layouts = {text!r}: expected comma-separated key=value")
    assert why in message and "\n" not in message


def test_per_rank_batch_size_keeps_the_global_batch():
    assert pc.per_rank_batch_size(8, pc.parse_layout("dp_shard=2")) == 4
    assert pc.per_rank_batch_size(8, pc.parse_layout("dp_replicate=2,dp_shard=2")) == 2
    assert pc.per_rank_batch_size(8, pc.parse_layout("tp=2,pp=2")) == 8  # no data split
    assert pc.per_rank_batch_size(8, pc.REFERENCE) == 8


def test_per_rank_batch_size_refuses_a_batch_the_layout_cannot_split():
    with pytest.raises(ConfigError) as info:
        pc.per_rank_batch_size(6, pc.parse_layout("dp_shard=4"))
    assert str(info.value).startswith(
        "train.batch_size = 6: expected a multiple of the data-parallel degree 4 of layout "
        "'dp_shard=4'"
    )


def test_grad_accum_becomes_a_multiple_of_every_pp_only_when_needed():
    layouts = [pc.parse_layout(t) for t in ("dp_shard=2", "pp=2", "pp=3,tp=2")]
    assert pc.grad_accum_for(6, layouts) == 6
    assert pc.grad_accum_for(1, layouts) == 6
    assert pc.grad_accum_for(4, layouts[:2]) == 4
    assert pc.grad_accum_for(1, layouts[:1]) == 1


def test_grad_accum_gives_dualpipev_a_micro_batch_per_stage():
    """DualPipeV feeds both ends of its V at once: 2 * pp micro-batches at least."""
    dualpipev = pc.parse_layout("pp=2,schedule=dualpipev")
    assert pc.grad_accum_for(1, [dualpipev]) == 4
    assert pc.grad_accum_for(2, [dualpipev]) == 4
    assert pc.grad_accum_for(6, [dualpipev]) == 6
    assert pc.grad_accum_for(1, [dualpipev, pc.parse_layout("pp=3")]) == 6


def test_pipeline_layouts_change_every_run_only_when_needed():
    plain = [pc.parse_layout("dp_shard=2")]
    assert pc.pipeline_overrides(1, plain) == ([], [])
    piped = [*plain, pc.parse_layout("pp=2")]
    overrides, notes = pc.pipeline_overrides(1, piped)
    # Document masking stays on: pipeline stages carry the document ids.
    assert overrides == ["--train.grad_accum_steps=2"]
    assert len(notes) == 1 and "every run, the reference included, uses 2" in notes[0]
    assert pc.pipeline_overrides(4, piped) == ([], [])


def test_train_command_runs_layouts_under_torchrun_and_the_reference_alone():
    common = dict(batch_size=8, steps=3, run_dir="/r")
    layout = pc.parse_layout("dp_shard=2,tp=2")
    overrides = pc.run_overrides(layout, ["--model.dim=64"], **common)
    command = pc.train_command("c.toml", layout, overrides)
    assert command[:6] == [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node=4",
        "-m",
    ]
    tail = command[command.index("train") :]
    assert tail[:3] == ["train", "c.toml", "--model.dim=64"]
    assert "--distributed.dp_shard=2" in tail and "--distributed.tp=2" in tail
    # The runner's settings come after the user's overrides, so they win.
    assert tail[-3:] == ["--train.batch_size=4", "--train.max_steps=3", "--train.run_dir=/r"]
    for setting in ("--metrics.log_interval=1", "--train.deterministic=true", "--eval.interval=0"):
        assert setting in tail
    reference_overrides = pc.run_overrides(pc.REFERENCE, [], **common)
    reference = pc.train_command("c.toml", pc.REFERENCE, reference_overrides)
    assert reference[:4] == [sys.executable, "-m", "kempnerforge", "train"]
    assert "--distributed.dp_shard=1" in reference and "--train.batch_size=8" in reference


def _write_metrics(run_dir, rows):
    run_dir.mkdir(parents=True, exist_ok=True)
    text = "".join(json.dumps(r) + "\n" for r in rows)
    (run_dir / pc.METRICS_FILE).write_text(text + '{"step": 9, "lo')  # a torn last row


def test_read_step_rows_keeps_training_rows_and_the_latest_of_a_step(tmp_path):
    _write_metrics(
        tmp_path,
        [
            {"step": 1, "loss": 5.0, "grad_norm": 2.0},
            {"step": 1, "event": "checkpoint", "path": "x"},
            {"step": 1, "eval_loss": 4.0},
            {"step": 2, "loss": 4.0, "grad_norm": None},
            {"step": 2, "loss": 3.5, "grad_norm": 1.0},  # after a resume, supersedes
        ],
    )
    assert pc.read_step_rows(str(tmp_path)) == {1: (5.0, 2.0), 2: (3.5, 1.0)}
    assert pc.read_step_rows(str(tmp_path / "missing")) == {}


def test_compare_runs_reports_the_largest_relative_differences():
    reference = {1: (5.0, 2.0), 2: (4.0, 1.0)}
    rows = {1: (5.0005, 2.0), 2: (4.0, 1.001)}
    result = pc.compare_runs(pc.parse_layout("dp_shard=2"), rows, reference, steps=2)
    assert result.loss_diff == pytest.approx(1e-4)
    assert result.grad_norm_diff == pytest.approx(1e-3)
    assert result.passed(1e-3) and not result.passed(5e-4)


def test_compare_runs_fails_missing_or_non_finite_steps():
    layout = pc.parse_layout("tp=2")
    reference = {1: (5.0, 2.0), 2: (4.0, 1.0)}
    missing = pc.compare_runs(layout, {1: (5.0, 2.0)}, reference, steps=2)
    assert missing.problem == "no metrics row for step(s) [2]" and not missing.passed(1.0)
    nan = pc.compare_runs(layout, {1: (5.0, 2.0), 2: (None, 1.0)}, reference, steps=2)
    assert nan.problem == "non-finite loss or grad_norm at step 2" and not nan.passed(1.0)


def test_relative_diff_falls_back_to_absolute_at_zero():
    assert pc.relative_diff(0.5, 0.0) == 0.5
    assert pc.relative_diff(-2.0, -1.0) == 1.0


def test_format_table_states_the_measure_and_marks_each_layout():
    good = pc.Comparison(pc.parse_layout("dp_shard=2"), 1.5e-7, 3e-6)
    bad = pc.Comparison(pc.parse_layout("pp=2,schedule=1f1b"), 2e-3, 1e-6)
    failed = pc.Comparison(pc.parse_layout("tp=2"), problem="exit code 1")
    lines = pc.format_table([good, bad, failed], tolerance=1e-4, steps=3).splitlines()
    assert lines[0].startswith("rel d = max over steps 1..3 of |x - x_ref| / |x_ref|")
    assert "PASS when both are <= 0.0001" in lines[0]
    assert lines[1].split() == ["layout", "world", "max", "rel", "dloss", "max", "rel"] + [
        "dgrad_norm",
        "result",
    ]
    assert lines[2].split() == ["dp_shard=2", "2", "1.50e-07", "3.00e-06", "PASS"]
    assert lines[3].split() == ["pp=2,schedule=1f1b", "2", "2.00e-03", "1.00e-06", "FAIL"]
    assert lines[4].split() == ["tp=2", "2", "-", "-", "FAIL"]
    assert all(line.isascii() for line in lines)


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["c.toml"], "the following arguments are required: --layouts"),
        (["c.toml", "stray", "--layouts", "tp=2"], "unrecognized arguments: stray"),
        (["c.toml", "--layouts", "tp=2", "--steps", "0"], "--steps must be >= 1, got 0"),
        (["c.toml", "--layouts", "tp=2", "--tolerance", "nan"], "--tolerance must be a number"),
        (["c.toml", "--layouts", "dp_shard=4", "--nproc", "2"], "needs 4 processes"),
        (["c.toml", "--layouts", "tp=x"], "--layouts = 'tp=x': expected"),
        (["c.toml", "--layouts", "all", "tp=2"], "--layouts all takes no other layout"),
        (["c.toml", "--layouts", "tp=2", "tp=2"], "names the same layout twice"),
    ],
)
def test_main_refuses_bad_arguments_with_one_line_and_exit_2(argv, message, capsys):
    assert check_parallel(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("kempnerforge check-parallel: error: ") and message in err
    assert err.count("\n") == 1


def test_main_refuses_an_indivisible_batch_before_running_anything(tmp_path, capsys):
    config = tmp_path / "c.toml"
    config.write_text("[train]\nbatch_size = 6\n")
    argv = [str(config), "--layouts", "dp_shard=4", "--nproc", "4", "--runs-dir", str(tmp_path)]
    assert check_parallel(argv) == 2
    err = capsys.readouterr().err
    assert "train.batch_size = 6: expected a multiple of the data-parallel degree 4" in err
    assert not (tmp_path / "reference").exists()


def test_main_refuses_a_bad_override_as_a_config_error(tmp_path, capsys):
    config = tmp_path / "c.toml"
    config.write_text("")
    argv = [str(config), "--layouts", "tp=2", "--nproc", "2", "--trian.batch_size=2"]
    assert check_parallel(argv) == 2
    assert "trian" in capsys.readouterr().err


def test_output_tail_shows_the_ranks_error_not_the_launchers():
    text = "\n".join(
        ["setup"] * 30
        + ["*" * 41, "Setting OMP_NUM_THREADS environment variable for each process", "*" * 41]
        + ["kempnerforge: error: distributed.tp = 3: expected a divisor"] * 3
        + ["E1203 13:47:08.508000 6004 torch/distributed/elastic/api.py:1002] failed"]
        + ["Traceback (most recent call last):", '  File "torchrun", line 8']
        + ["torch.distributed.elastic.multiprocessing.errors.ChildFailedError: "]
        + ["=" * 60, "kempnerforge FAILED", "  exitcode  : 2"]
    )
    assert pc.output_tail(text, lines=2).splitlines() == [
        "    setup",
        "    kempnerforge: error: distributed.tp = 3: expected a divisor",
    ]
    assert "*" not in pc.output_tail(text, lines=5)
    assert pc.output_tail("a\nb\nc", lines=2) == "    b\n    c"


def test_output_tail_names_the_ranks_torchrun_saw_fail_and_how():
    """A rank killed by a signal prints nothing of its own: the launcher's summary is the
    only place its end is told."""
    summary = [
        "Traceback (most recent call last):",
        "torch.distributed.elastic.multiprocessing.errors.ChildFailedError: ",
        "=" * 60,
        "kempnerforge FAILED",
        "Failures:",
        "[1]:",
        "  rank      : 1 (local_rank: 1)",
        "  exitcode  : -11 (pid: 4242) SIGSEGV",
        "  traceback : Signal 11 (SIGSEGV) received by PID 4242",
        "Root Cause (first observed failure):",
        "[0]:",
        "  rank      : 0 (local_rank: 0)",
        "  exitcode  : 1 (pid: 4241)",
    ]
    text = "\n".join(["kempnerforge: error: rank 0: a collective failed", *summary])
    assert pc.output_tail(text).splitlines() == [
        "    kempnerforge: error: rank 0: a collective failed",
        "    rank 1 ended with signal SIGSEGV (torchrun)",
        "    rank 0 ended with exit code 1 (torchrun)",
    ]


def test_sweep_layouts_cover_every_mesh_schedule_and_expert_degree():
    from kempnerforge.launch.layout_sweep import sweep_layouts

    dense = [layout.text for layout in sweep_layouts(2, moe=False)]
    # 5 mesh dimensions of 2, the pipeline one once per schedule (6), cp also as a ring.
    assert len(dense) == len(set(dense)) == 4 + 6 + 1
    assert {"tp=2", "cp=2", "dp_shard=2", "dp_replicate=2", "pp=2,schedule=zbv"} <= set(dense)
    assert "cp=2,ring=2" in dense
    moe = [layout.text for layout in sweep_layouts(2, moe=True)]
    expert = {"dp_shard=2,ep=2", "cp=2,ep=2", "cp=2,ep=2,ring=2"}
    assert expert <= set(moe) and len(moe) == len(dense) + 3
    # Worlds of 3 and 4: 5 + 15 meshes, 1 + 5 of them pipelined (60 with the config's cp
    # attention); and the rings of each cp mesh: cp 2 in 5 meshes, the pipelined one once
    # per schedule (4 + 6), cp 3 (1), cp 4 with rings of 2 and 4 (2).
    assert len(sweep_layouts(4, moe=False)) == 60 + 4 + 6 + 1 + 2
    for layout in sweep_layouts(4, moe=True):  # each text reads back as its layout
        assert pc.parse_layout(layout.text) == layout


def test_refused_layouts_are_named_with_the_launchs_error():
    from kempnerforge.launch.layout_sweep import format_refusals, refusal_of

    def refuse_tp(layout):
        if layout.tp > 1:
            raise ConfigError("distributed.tp", layout.tp, "1")

    assert refusal_of(pc.parse_layout("dp_shard=2"), refuse_tp) is None
    refusal = refusal_of(pc.parse_layout("tp=2"), refuse_tp)
    assert refusal is not None and refusal.field == "distributed.tp"
    assert (
        format_refusals([refusal]) == "tp=2 (2 processes): REFUSED distributed.tp = 2: expected 1"
    )
    refused = pc.Comparison(pc.parse_layout("tp=2"), problem="refused", refused=True)
    table = pc.format_table([refused], tolerance=1e-4, steps=3).splitlines()
    assert table[2].split() == ["tp=2", "2", "-", "-", "REFUSED"]


def test_main_lists_accepted_and_refused_layouts_without_running_them(tmp_path, capsys):
    config = tmp_path / "c.toml"
    config.write_text("[model]\nn_heads = 4\nn_kv_heads = 4\n")
    argv = [str(config), "--layouts", "tp=2", "tp=3", "--dry-run", "--runs-dir", str(tmp_path)]
    assert check_parallel(argv) == 0
    out = capsys.readouterr().out
    assert "tp=3 (3 processes): REFUSED distributed.tp = 3: expected a divisor of" in out
    assert "accepted (1): tp=2" in out
    assert not (tmp_path / "reference").exists()


def test_batches_group_layouts_by_world_size_and_leave_lone_ones_out():
    from kempnerforge.launch.layout_batches import batches

    layouts = [pc.parse_layout(t) for t in ("dp_shard=2", "pp=2,tp=2", "tp=2", "cp=4", "cp=2")]
    assert [[layout.text for layout in batch] for batch in batches(layouts)] == [
        ["dp_shard=2", "tp=2", "cp=2"],
        ["pp=2,tp=2", "cp=4"],
    ]
    assert batches(layouts[:2]) == []


def test_a_batch_command_runs_the_batch_module_under_torchrun():
    from kempnerforge.launch.layout_batches import BATCH_MODULE, batch_command

    command = batch_command("/runs/batch_2.json", 2)
    assert command[1:] == [
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node=2",
        "-m",
        BATCH_MODULE,
        "/runs/batch_2.json",
    ]
    assert BATCH_MODULE == "kempnerforge.commands.layout_batch"
