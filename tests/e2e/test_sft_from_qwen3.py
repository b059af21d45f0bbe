"""End to end: chat fine-tuning from an imported Hugging Face Qwen3, as docs/training.md's
"From a Hugging Face model" shows it. The section's job file and commands are read from the
doc and run as written (shortened), so the documented recipe cannot drift from one that
works; the model folder they name is a tiny random Qwen3ForCausalLM made by transformers
with a Qwen3 tokenizer folder (tests/support/chat_models.py: Qwen3's own chat template).
transformers then loads the export and must render, score and answer as we do."""

from __future__ import annotations

import json
import math
import re
import shlex
import subprocess
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from kempnerforge.model import generate
from tests.support import hf_families as fam
from tests.support.chat_models import SETUPS_BY_NAME, make_model_tokenizer_dir, training_texts
from tests.support.cli import REPO, run_kempnerforge, run_python
from tests.support.data_files import prepared_ids
from tests.support.metrics_rows import read_rows
from tests.support.threads import PROCESS_THREADS

pytestmark = pytest.mark.slow
transformers = pytest.importorskip("transformers")

DOC = REPO / "docs" / "training.md"
SECTION = "### From a Hugging Face model"
SEQ = 128
"""Windows of the shortened run, and the tiny model's max_position_embeddings."""
STEPS = 30
NEW_TOKENS = 24
SHORTER = {"--count 4000": "--count 96", "--seq-len 1024": f"--seq-len {SEQ}"}
"""What the commands' own arguments become in the shortened run."""
TRAIN = [
    f"--train.seq_len={SEQ}",
    f"--train.max_steps={STEPS}",
    "--train.device=cpu",
    "--optimizer.lr=1e-2",  # the tiny model learns the reply's form in 30 full-batch steps
    "--scheduler.warmup_steps=2",
    f"--eval.interval={STEPS}",
    "--eval.steps=1",
    "--checkpoint.interval=0",
    "--metrics.log_interval=1",
    "--metrics.progress=off",
]
"""Appended to the train command (train.batch_size too: every window in each step)."""
GENERATE = ["--temperature=0", f"--max-new-tokens={NEW_TOKENS}"]
ASSISTANT_SPAN = re.compile(r"<\|im_start\|>assistant\n(.*?<\|im_end\|>)", re.DOTALL)
"""What an assistant says in a ChatML render, through its end-of-turn token: read from
transformers' render, independently of how prepare-data finds a turn."""


def section_blocks() -> tuple[str, list[str]]:
    """The job file (the section's toml block) and its command lines (its sh block)."""
    text = DOC.read_text().split(SECTION, 1)[1]
    text = re.split(r"^##", text, maxsplit=1, flags=re.MULTILINE)[0]
    blocks = dict(re.findall(r"^```(toml|sh)\n(.*?)^```", text, re.MULTILINE | re.DOTALL))
    return blocks["toml"], blocks["sh"].splitlines()


def kempnerforge(argv: list[str], cwd: Path) -> subprocess.CompletedProcess[str]:
    result = run_kempnerforge(
        *argv, cwd=cwd, env_extra={"OMP_NUM_THREADS": PROCESS_THREADS}, timeout=600
    )
    assert result.returncode == 0, f"{argv}\n{result.stderr[-3000:]}"
    return result


def option(argv: list[str], name: str) -> str:
    return argv[argv.index(name) + 1]


def make_qwen3_folder(folder: Path) -> None:
    """A Qwen3 folder as published, tiny: Qwen3's tokenizer files and chat template, and a
    random Qwen3ForCausalLM of its vocabulary (head size 16 at width 32 over 4 heads, tied
    embeddings as the small Qwen3s; <|endoftext|> and <|im_end|> as BOS and EOS ids)."""
    make_model_tokenizer_dir(SETUPS_BY_NAME["qwen3"], folder, training_texts())
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(folder))
    fam.make_hf_folder(
        transformers.Qwen3Config,
        transformers.Qwen3ForCausalLM,
        folder,
        vocab_size=len(tokenizer),
        head_dim=16,
        tie_word_embeddings=True,
        max_position_embeddings=SEQ,
        bos_token_id=tokenizer.convert_tokens_to_ids("<|endoftext|>"),
        eos_token_id=tokenizer.convert_tokens_to_ids("<|im_end|>"),
        pad_token_id=None,
    )


@pytest.fixture(scope="module")
def recipe(tmp_path_factory) -> dict[str, Any]:
    """Run the section's commands in order in a fresh directory; what they wrote and said."""
    root = tmp_path_factory.mktemp("sft_from_qwen3")
    job, lines = section_blocks()
    for doc_text, short in SHORTER.items():
        assert sum(doc_text in line for line in lines) == 1, f"the doc's {doc_text!r} moved"
        lines = [line.replace(doc_text, short) for line in lines]
    commands = [shlex.split(line) for line in lines]
    by_name = {argv[1]: argv for argv in commands if argv[0].endswith("kempnerforge")}
    make_qwen3_folder(root / option(by_name["import-hf"], "--model"))
    (root / by_name["train"][2]).write_text(job)
    outputs: dict[str, str] = {}
    for argv in commands:
        program, args = Path(argv[0]).name, argv[1:]
        if program == "python":
            made = run_python(*args, cwd=root, env_extra={"PYTHONPATH": str(REPO)})
            assert made.returncode == 0, made.stderr[-3000:]
            continue
        assert program == "kempnerforge", argv
        if args[0] == "train":
            corpus = root / option(by_name["prepare-data"], "--output")
            meta = json.loads((corpus / "meta.json").read_text())
            windows = (meta["num_tokens"] - 1) // SEQ
            args += [*TRAIN, f"--train.batch_size={windows}"]
        elif args[0] == "generate":
            args += GENERATE
        outputs[args[0]] = kempnerforge(args, root).stdout
    return {"root": root, "commands": by_name, "outputs": outputs, "job": job}


def path_of(recipe: dict[str, Any], command: str, name: str) -> Path:
    """The path a command's option names, in the recipe's directory."""
    return recipe["root"] / option(recipe["commands"][command], name)


@pytest.fixture(scope="module")
def exported(recipe) -> tuple[Any, Any]:
    """transformers' AutoTokenizer and AutoModelForCausalLM of the exported folder; every
    tensor of the folder used, none missing."""
    folder = str(path_of(recipe, "export", "--out"))
    tokenizer = transformers.AutoTokenizer.from_pretrained(folder)
    model, info = transformers.AutoModelForCausalLM.from_pretrained(
        folder, dtype=torch.float32, output_loading_info=True
    )
    for key in ("missing_keys", "unexpected_keys", "mismatched_keys"):
        assert not info[key], (key, info[key])
    return tokenizer, model.eval()


@pytest.fixture(scope="module")
def ours(recipe) -> tuple[Any, Any, list[dict[str, Any]]]:
    """Our model from the fine-tuned checkpoint, as generate loads it, the --chat
    conversation and generate's prompt of it (chat_prompt)."""
    from kempnerforge.data.tokenizer import load_tokenizer
    from kempnerforge.training.inference import (
        chat_prompt,
        load_for_inference,
        open_for_inference,
        read_conversation,
    )

    tokenizer_dir = str(path_of(recipe, "import-hf", "--model"))
    job = open_for_inference(
        "generate",
        str(path_of(recipe, "generate", "--checkpoint")),
        overrides=[f"--data.tokenizer={tokenizer_dir}"],  # the job file's is relative
        validate=False,
        device="cpu",
    )
    messages = read_conversation(option(recipe["commands"]["generate"], "--chat"))
    tokenizer = load_tokenizer(tokenizer_dir)
    prompt = chat_prompt(
        tokenizer, job.config.model, job.config.data, messages, max_new_tokens=NEW_TOKENS
    )
    return load_for_inference(job), prompt, messages


def test_the_job_file_builds_the_imported_model_from_its_weights(recipe):
    imported = Path(option(recipe["commands"]["import-hf"], "--out"))
    assert f'include = ["{imported / "model.toml"}"]' in recipe["job"]
    assert f'resume_from = "{imported / "step_0"}"' in recipe["job"]
    table = (recipe["root"] / imported / "model.toml").read_text().splitlines()
    # Qwen3's own: a head size apart from the width's share (32 / 4), per-head q/k norms.
    for line in ("head_size = 16", 'qk_norm = "per_head"', "tie_embeddings = true"):
        assert line in table
    rows = read_rows(path_of(recipe, "generate", "--checkpoint"))
    events = {r["event"]: r for r in rows if "event" in r}
    assert events["load_weights"]["path"] == str(imported / "step_0")
    assert events["load_weights"]["step"] == 0 and "resume" not in events


def documents(corpus: Path) -> list[tuple[list[int], list[bool]]]:
    """The documents of a masked corpus: ids and loss bits, split at its document ends."""
    ids = prepared_ids(corpus).tolist()
    flags = np.fromfile(corpus / "token_flags.bin", dtype=np.uint8)
    ends = np.flatnonzero(flags & 2).tolist()
    starts = [0, *(e + 1 for e in ends[:-1])]
    return [
        (ids[s : e + 1], (flags[s : e + 1] & 1).astype(bool).tolist())
        for s, e in zip(starts, ends, strict=True)
    ]


def assistant_mask(tokenizer: Any, messages: list[dict[str, Any]]) -> tuple[list[int], list[bool]]:
    """transformers' ids of a conversation, and which of them lie in what an assistant
    says (ASSISTANT_SPAN of its rendered text)."""
    text = tokenizer.apply_chat_template(messages, tokenize=False)
    encoded = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    spans = [m.span(1) for m in ASSISTANT_SPAN.finditer(text)]
    offsets = encoded["offset_mapping"]
    return encoded["input_ids"], [any(a <= s and e <= b for a, b in spans) for s, e in offsets]


def test_every_prepared_conversation_is_the_exports_render_supervised_on_the_assistant(
    recipe, exported
):
    tokenizer, _ = exported
    source = path_of(recipe, "prepare-data", "--input").read_text().splitlines()
    rendered = [assistant_mask(tokenizer, json.loads(line)["messages"]) for line in source]
    masks = {tuple(ids): mask for ids, mask in rendered}
    corpus = path_of(recipe, "prepare-data", "--output")
    supervised = conversations = 0
    for ids, mask in documents(corpus):
        if set(ids) == {tokenizer.pad_token_id} and not any(mask):
            continue  # a window's padding after its last conversation
        assert tuple(ids) in masks, tokenizer.decode(ids)
        assert mask == masks[tuple(ids)], tokenizer.decode(ids)
        supervised += sum(mask)
        conversations += 1
    meta = json.loads((corpus / "meta.json").read_text())
    assert conversations == meta["num_documents"] and supervised == meta["assistant_tokens"]


def test_each_step_trains_on_the_assistant_tokens_only_and_the_loss_falls(recipe):
    corpus = path_of(recipe, "prepare-data", "--output")
    assistant_tokens = json.loads((corpus / "meta.json").read_text())["assistant_tokens"]
    rows = read_rows(path_of(recipe, "generate", "--checkpoint"))
    train = [r for r in rows if "loss" in r and "event" not in r]
    assert [r["step"] for r in train] == list(range(1, STEPS + 1))
    # A batch of every window: each step's targets are all of the corpus's assistant
    # tokens and nothing else.
    assert {r["supervised_tokens"] for r in train} == {assistant_tokens}
    losses = [r["loss"] for r in train]
    assert all(math.isfinite(x) for x in losses) and losses[-1] < losses[0], losses
    [evaluated] = [r for r in rows if "eval_loss" in r and "event" not in r]
    assert math.isfinite(evaluated["eval_loss"])


def test_the_export_is_a_tied_qwen3_that_stops_at_the_end_of_turn(recipe, exported):
    tokenizer, model = exported
    folder = path_of(recipe, "export", "--out")
    config = json.loads((folder / "config.json").read_text())
    assert config["architectures"] == ["Qwen3ForCausalLM"] and config["model_type"] == "qwen3"
    assert config["tie_word_embeddings"] is True and config["head_dim"] == 16
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    generation = json.loads((folder / "generation_config.json").read_text())
    assert tokenizer.convert_tokens_to_ids("<|im_end|>") in generation["eos_token_id"]


def test_transformers_renders_scores_and_answers_as_we_do(recipe, exported, ours):
    tokenizer, theirs = exported
    model, prompt, messages = ours
    ids = tokenizer.apply_chat_template(
        messages, add_generation_prompt=True, return_tensors="pt", return_dict=False
    )
    assert ids[0].tolist() == prompt.ids
    with torch.no_grad():
        fam.assert_close_logits(model(ids), theirs(ids).logits, model.cfg)
        output = theirs.generate(ids, do_sample=False, max_new_tokens=NEW_TOKENS)
    new = output[0, ids.shape[1] :].tolist()
    if new[-1] in prompt.stop_ids:
        new = new[:-1]  # ours stops before the end-of-turn token, transformers after it
    assert generate(model, prompt.ids, NEW_TOKENS, temperature=0.0, stop_ids=prompt.stop_ids) == new
    assert recipe["outputs"]["generate"] == tokenizer.decode(new, skip_special_tokens=True) + "\n"
