"""Conversations against plain text with the same content: prepare-data tokens per second
(the chat template rendered, tokenized with offsets, the loss mask built) and training
tokens per second (labels and document ids from token_flags.bin against EOS-split text).

The content is this interpreter's standard library source cut into paragraphs (nothing
downloaded). Each conversation is a system turn, then two user/assistant exchanges, each
turn one paragraph; the text corpus holds the same paragraphs, one document per
conversation. The tokenizer is a byte-level BPE trained on that source, with a ChatML
template in its tokenizer_config.json. Each figure is the median of --rounds runs, the two
kinds alternating (a machine whose load drifts slows both alike):

    python bench/chat_data.py [--mb 2] [--rounds 3] [--steps 20] [--seq-len 1024]

Prepare figures are tokens written over the wall clock of prepare_data (one worker);
training figures are tokens_seen over the time of steps --skip..--steps of the debug config
with the tokenizer's vocabulary, as bench/throughput.py measures them.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from prepare_data import source_files, train_tokenizer

REPO = Path(__file__).resolve().parents[1]
CHATML = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + "
    "message['content'] + '<|im_end|>' + '\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<pad>"]


def paragraphs(files: list[Path]) -> list[str]:
    """The non-empty blank-line-separated paragraphs of ``files``, in order."""
    found = []
    for path in files:
        try:
            text = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError):
            continue
        found += [p.strip() for p in text.split("\n\n") if p.strip()]
    return found


def write_inputs(parts: list[str], directory: Path) -> tuple[Path, Path]:
    """(chats.jsonl, text.jsonl) holding the same paragraphs, five to a conversation."""
    chats, texts = directory / "chats.jsonl", directory / "text.jsonl"
    with chats.open("w") as chat_file, texts.open("w") as text_file:
        for i in range(0, len(parts) - 4, 5):
            system, *turns = parts[i : i + 5]
            roles = ["user", "assistant", "user", "assistant"]
            messages = [{"role": "system", "content": system}]
            messages += [{"role": r, "content": c} for r, c in zip(roles, turns, strict=True)]
            chat_file.write(json.dumps({"messages": messages}) + "\n")
            text_file.write(json.dumps({"text": "\n\n".join(parts[i : i + 5])}) + "\n")
    return chats, texts


def tokenizer_dir(files: list[Path], directory: Path) -> Path:
    """A tokenizer directory: BPE (8,192 ids) trained on ``files``, ChatML template."""
    import tokenizers

    directory.mkdir(parents=True, exist_ok=True)
    path = train_tokenizer(files, 8192, directory / "tokenizer.json")
    tok = tokenizers.Tokenizer.from_file(path)
    tok.add_special_tokens(SPECIALS)
    tok.save(path)
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "eos_token": "<|endoftext|>",
        "pad_token": "<pad>",
        "chat_template": CHATML,
    }
    (directory / "tokenizer_config.json").write_text(json.dumps(config))
    return directory


def prepare(
    source: Path, output: Path, tokenizer: str, chat: bool, seq_len: int
) -> tuple[float, dict]:
    """Tokens per second of one prepare_data run of ``source`` into ``output``, and the
    meta.json it wrote."""
    from kempnerforge.data.chat.packing import Packing
    from kempnerforge.data.chat.template import load_chat_template
    from kempnerforge.data.prepare.corpus import prepare_data
    from kempnerforge.data.tokenizer import load_tokenizer

    tok = load_tokenizer(tokenizer)
    options = {}
    if chat:  # packed into whole windows of the training length, as prepare-data requires
        options = {"chat_template": load_chat_template(tokenizer), "packing": Packing(seq_len)}
    started = time.perf_counter()
    meta = prepare_data([str(source)], str(output), tok, **options)
    return meta["num_tokens"] / (time.perf_counter() - started), meta


def train(data: Path, tokenizer: str, args: argparse.Namespace) -> float:
    """Tokens per second of the debug model trained on ``data`` (steps skip..steps)."""
    with tempfile.TemporaryDirectory() as run_dir:
        command = [
            sys.executable, "-m", "kempnerforge", "train", "configs/train/debug.toml",
            f"--data.path={data}", f"--data.tokenizer={tokenizer}", "--model.vocab_size=8256",
            f"--train.max_steps={args.steps}", f"--train.run_dir={run_dir}",
            f"--train.seq_len={args.seq_len}", f"--model.max_seq_len={args.seq_len}",
            "--eval.interval=0", "--checkpoint.interval=0",
            "--train.sample_prompt=", "--metrics.log_interval=1", "--metrics.progress=off",
        ]  # fmt: skip
        proc = subprocess.run(command, cwd=REPO, capture_output=True, text=True)
        if proc.returncode != 0:
            raise SystemExit(f"training on {data} failed:\n{proc.stderr[-2000:]}")
        with open(os.path.join(run_dir, "metrics.jsonl")) as f:
            rows = [json.loads(line) for line in f]
    steps = {r["step"]: r for r in rows if "event" not in r and "loss" in r}
    first, last = steps[args.skip], steps[args.steps]
    return (last["tokens_seen"] - first["tokens_seen"]) / (last["time"] - first["time"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mb", type=float, default=2.0, help="megabytes of source text")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--skip", type=int, default=5, help="warm-up steps left out")
    parser.add_argument(
        "--seq-len", type=int, default=1024, help="long enough that no conversation is cut"
    )
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        files = source_files(int(args.mb * 1e6))
        tokenizer = str(tokenizer_dir(files, root / "tokenizer"))
        chats, texts = write_inputs(paragraphs(files), root)
        figures: dict[str, list[float]] = {}
        for round_ in range(args.rounds):
            for kind, source in (("text", texts), ("chat", chats)):
                out = root / f"{kind}-{round_}"
                rate, meta = prepare(source, out, tokenizer, kind == "chat", args.seq_len)
                if round_ == 0:
                    keys = ("num_tokens", "num_documents", "pad_tokens", "conversations_cut")
                    print(json.dumps({"corpus": kind, **{k: meta.get(k) for k in keys}}))
                figures.setdefault(f"prepare {kind}", []).append(rate)
                figures.setdefault(f"train {kind}", []).append(train(out, tokenizer, args))
        medians = {key: statistics.median(values) for key, values in figures.items()}
        for key, value in medians.items():
            print(
                json.dumps({"setting": key, "tokens_per_sec": round(value), "runs": figures[key]})
            )
        for part in ("prepare", "train"):
            ratio = medians[f"{part} chat"] / medians[f"{part} text"]
            print(json.dumps({"setting": f"{part}: chat / text", "ratio": round(ratio, 3)}))


if __name__ == "__main__":
    main()
