"""End to end: fine-tune a tiny model on conversations whose assistant answers a word with
'OK: low' or 'OK: high' by its first letter, then answer held-out words with `kempnerforge
generate --chat`, and with transformers from the folder `kempnerforge export --format hf`
writes."""

from __future__ import annotations

import itertools
import json
import pathlib
import random
import subprocess

import pytest

from tests.support.chat_files import make_chat_tokenizer_dir, write_conversations
from tests.support.cli import run_kempnerforge
from tests.support.threads import PROCESS_THREADS

pytestmark = pytest.mark.slow

REPO = pathlib.Path(__file__).parents[2]
DEBUG = str(REPO / "configs" / "train" / "debug.toml")
LETTERS = "cdfgkmnpqvwxz"
LOW = "cdfgkm"
"""Words starting with one of these are answered 'OK: low', the others 'OK: high'."""
HELD_OUT = {"kpz": "OK: low", "zqm": "OK: high"}
"""Words no training conversation has, and their answers: the format and the rule, not a
memory. (Copying the word into the answer took this model 600 to over 1,000 steps,
depending on the data order; the rule is learned in under 100.)"""
STEPS = 200


def kempnerforge(*args: str, timeout: float = 600) -> subprocess.CompletedProcess:
    return run_kempnerforge(*args, env_extra={"OMP_NUM_THREADS": PROCESS_THREADS}, timeout=timeout)


def question(word: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": word}]


def answer(word: str) -> str:
    return "OK: low" if word[0] in LOW else "OK: high"


def training_words(tokenizer_json: str) -> list[str]:
    """3-letter words whose letters stay one token each after a newline, so that a first
    letter is one token (the test tokenizer merges 'er', 'he', ...)."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(tokenizer_json)
    words = ["".join(p) for p in itertools.product(LETTERS, repeat=3)]
    return [w for w in words if len(tok.encode("\n" + w).ids) == 4]


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> dict[str, pathlib.Path]:
    """The tokenizer directory (ChatML) and the run directory of the fine-tuned model."""
    pytest.importorskip("tokenizers")
    root = tmp_path_factory.mktemp("chat_generate")
    tok = make_chat_tokenizer_dir(root / "tok")
    words = training_words(str(tok / "tokenizer.json"))
    assert set(HELD_OUT) <= set(words)
    words = [w for w in words if w not in HELD_OUT]
    random.Random(0).shuffle(words)
    records = [
        {"messages": [*question(w), {"role": "assistant", "content": answer(w)}]} for w in words
    ]
    source = write_conversations(root / "chats.jsonl", records * 2)
    prepared = kempnerforge(
        "prepare-data", "--format", "chat", "--input", str(source), "--output",
        str(root / "train"), "--tokenizer", str(tok), "--eval-fraction", "0.05",
        "--eval-output", str(root / "eval"), "--no-progress", "--seq-len", "128",
    )  # fmt: skip
    assert prepared.returncode == 0, prepared.stderr[-3000:]
    run_dir = root / "run"
    result = kempnerforge(
        "train",
        DEBUG,
        "--model.dim=64",
        "--model.n_layers=2",
        "--model.n_heads=4",
        "--model.multiple_of=16",
        "--model.max_seq_len=128",
        "--model.vocab_size=300",
        f"--data.tokenizer={tok}",
        f"--data.path={root / 'train'}",
        f"--data.eval_path={root / 'eval'}",
        "--train.batch_size=16",
        "--train.seq_len=128",
        f"--train.max_steps={STEPS}",
        "--train.sample_prompt=",
        f"--train.run_dir={run_dir}",
        "--train.device=cpu",
        "--optimizer.lr=5e-3",
        "--optimizer.weight_decay=0",
        "--scheduler.warmup_steps=20",
        "--metrics.progress=off",
        "--metrics.log_interval=50",
        "--checkpoint.interval=0",
        "--eval.interval=0",
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return {"tokenizer": tok, "run": run_dir}


def test_generate_chat_answers_a_held_out_word_in_the_trained_format(trained):
    first, second = HELD_OUT
    assert (answer(first), answer(second)) == (HELD_OUT[first], HELD_OUT[second])
    greedy = ["--temperature=0", "--max-new-tokens=20", "--checkpoint", str(trained["run"])]
    reply = kempnerforge("generate", *greedy, "--chat", json.dumps(question(first)))
    assert reply.returncode == 0, reply.stderr[-3000:]
    # The reply alone: the end-of-turn token stopped it and is not printed.
    assert reply.stdout == HELD_OUT[first] + "\n"
    chat = trained["run"].parent / "chat.json"
    chat.write_text(json.dumps({"messages": question(second)}))
    answered = kempnerforge("generate", *greedy, "--chat", str(chat), "--json")
    assert answered.returncode == 0, answered.stderr[-3000:]
    assert json.loads(answered.stdout) == [
        *question(second),
        {"role": "assistant", "content": HELD_OUT[second]},
    ]


def test_the_exported_model_answers_the_same_through_transformers(trained, tmp_path):
    transformers = pytest.importorskip("transformers")
    out = tmp_path / "hf"
    exported = kempnerforge(
        "export", "--checkpoint", str(trained["run"]), "--out", str(out), "--format", "hf"
    )
    assert exported.returncode == 0, exported.stderr[-3000:]
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(out))
    model = transformers.AutoModelForCausalLM.from_pretrained(str(out))
    for word in HELD_OUT:
        ids = tokenizer.apply_chat_template(
            question(word), add_generation_prompt=True, return_tensors="pt", return_dict=False
        )
        # generation_config.json's eos_token_id list stops it at <|im_end|>.
        output = model.generate(ids, do_sample=False, max_new_tokens=20)
        new = output[0, ids.shape[1] :].tolist()
        assert new[-1] == tokenizer.convert_tokens_to_ids("<|im_end|>")
        assert tokenizer.decode(new, skip_special_tokens=True) == HELD_OUT[word]
