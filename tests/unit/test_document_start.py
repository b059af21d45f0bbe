"""A scored text starts as the training documents started (evaluation/document_start.py):
after BOS, after the EOS before it, or with its own first token, as the data and document
masking decide; said in the log; and a task's log-likelihood is then what transformers
computes for the text on the exported model."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from kempnerforge.config.eval import EvalTaskConfig
from kempnerforge.config.loader import load_config
from kempnerforge.config.model import ModelConfig
from kempnerforge.data.pipeline_build import build_data_pipeline
from kempnerforge.data.prepare import prepare_data
from kempnerforge.data.tokenizer import ByteTokenizer
from kempnerforge.evaluation.document_start import DocumentStart, training_start
from kempnerforge.evaluation.scoring import slot_sums, whole_model_losses
from kempnerforge.evaluation.tasks import load_task
from kempnerforge.interop.hf import export_hf
from kempnerforge.model.transformer import Transformer
from tests.conftest import synthetic_documents
from tests.support.chat_files import turns, write_masked_dir
from tests.support.data_files import write_jsonl
from tests.support.tolerance import reorder_atol, transformer_terms

BYTES = ByteTokenizer()
SEQ_LEN = 64
TEXT = "def add(a, b):\n    return a + b\n"


def _corpus(tmp_path: Path, bos: bool, chat: bool = False) -> str:
    """A prepared directory of the byte tokenizer: plain documents, or conversations (a
    loss-masked corpus), with or without a BOS per document."""
    if chat:
        chats = [turns((b"user: hi ", False), (b"bot: hello", True))] * 20
        return write_masked_dir(tmp_path / "chat", chats, bos_per_document=bos)
    source = write_jsonl(tmp_path / "docs.jsonl", synthetic_documents(40))
    out = str(tmp_path / "plain")
    prepare_data([str(source)], out, BYTES, bos_per_document=bos)
    return out


@pytest.mark.parametrize(
    ("bos", "masking", "chat", "start", "said"),
    [
        (True, True, False, (BYTES.bos_id,), "BOS (id 256): the training documents began"),
        (True, False, False, (BYTES.bos_id,), "BOS (id 256)"),
        (False, False, False, (BYTES.eos_id,), "EOS (id 257): the training documents had no"),
        (False, True, False, (), "its own first token, which is not scored"),
        (False, False, True, (), "its own first token, which is not scored"),
    ],
)
def test_a_text_starts_as_the_training_documents_did(
    tmp_path, log, bos, masking, chat, start, said
):
    """Whether the training data is opened (training) or not (`eval --tasks` and the
    lm-eval model build without it: the training sources' meta.json is read)."""
    data = _corpus(tmp_path, bos, chat)
    cfg = load_config(
        None, [f"--data.path={data}", "--data.eval_path=", f"--data.document_masking={masking}"]
    ).data
    for with_train in (True, False):
        pipeline = build_data_pipeline(cfg, seq_len=8, batch_size=2, seed=0, with_train=with_train)
        assert training_start(BYTES, cfg, pipeline).ids == start
    assert f"evaluation reads each text after {said}" in log.text


def test_an_empty_context_without_a_start_token_reads_after_eos():
    assert DocumentStart.of(BYTES, bos=False).tokens([]) == [BYTES.eos_id]
    assert DocumentStart.of(BYTES, bos=False).tokens([7, 8]) == [7, 8]
    assert DocumentStart.of(BYTES, bos=True).tokens([7]) == [BYTES.bos_id, 7]


@pytest.fixture(scope="module")
def exported(tmp_path_factory) -> tuple[Transformer, torch.nn.Module]:
    """A random byte-level model (a wide init, so the context matters) and the same
    weights loaded by transformers from its export."""
    transformers = pytest.importorskip("transformers")
    cfg = ModelConfig(
        dim=32,
        n_layers=2,
        n_heads=4,
        vocab_size=BYTES.vocab_size,
        max_seq_len=SEQ_LEN,
        init_std=0.1,
    )
    model = Transformer(cfg)
    model.init_weights(0)
    model.eval()
    folder = export_hf(
        model, cfg, tmp_path_factory.mktemp("hf") / "hf", tokenizer_path="byte", model_type="llama"
    )
    theirs = transformers.LlamaForCausalLM.from_pretrained(folder, dtype=torch.float32)
    return model, theirs.eval()


def _task_nll(model: Transformer, tmp_path: Path, start: DocumentStart) -> tuple[float, int]:
    """The native bits_per_byte task's negative log-likelihood of TEXT and its tokens."""
    path = tmp_path / "text.jsonl"
    path.write_text(json.dumps({"text": TEXT}) + "\n")
    task = EvalTaskConfig(name="text", path=str(path), kind="bits_per_byte")
    loaded = load_task(task, BYTES, start, SEQ_LEN)
    cpu = torch.device("cpu")
    sums = slot_sums(
        model,
        loaded.windows,
        loaded.slots,
        whole_model_losses(model, cpu, 0),
        device=cpu,
        global_batch=1,
        rows_per_forward=1,
    )
    return sums[0, 0].item(), int(sums[0, 1].item())


def _transformers_nll(theirs: torch.nn.Module, ids: list[int], scored_from: int) -> float:
    """transformers' summed cross-entropy of ids[scored_from:], each given the ids before."""
    labels = torch.tensor([ids])
    labels[0, :scored_from] = -100
    with torch.no_grad():
        out = theirs(torch.tensor([ids]), labels=labels)
    return out.loss.item() * (len(ids) - scored_from)


@pytest.mark.parametrize(
    ("bos", "masking", "prefix"),
    [(False, True, []), (True, True, [BYTES.bos_id]), (False, False, [BYTES.eos_id])],
)
def test_a_task_scores_the_text_as_transformers_reads_the_trained_document(
    exported, tmp_path, bos, masking, prefix
):
    """A job without BOS that masks documents trained on each document from its own first
    token: its task scores the text's tokens after the first, as transformers scores the
    text (the labels its own ids); with BOS, or without masking, after that token.

    Two implementations of one forward: each token's log-probability within two
    reorderings of the forward's sums (transformer_terms at the largest |logit|), the
    tokens' sum in float32 (transformers' mean) at its size."""
    model, theirs = exported
    data = _corpus(tmp_path, bos)
    cfg = load_config(
        None, [f"--data.path={data}", "--data.eval_path=", f"--data.document_masking={masking}"]
    ).data
    pipeline = build_data_pipeline(cfg, seq_len=8, batch_size=2, seed=0, with_train=False)
    start = training_start(BYTES, cfg, pipeline)
    ids = [*prefix, *BYTES.encode(TEXT)]
    scored_from = max(len(prefix), 1)
    want = _transformers_nll(theirs, ids, scored_from)
    got, tokens = _task_nll(model, tmp_path, start)
    assert tokens == len(ids) - scored_from
    with torch.no_grad():
        logits = theirs(torch.tensor([ids])).logits
    terms = transformer_terms(model.cfg, SEQ_LEN, backward=False)
    bound = tokens * 2 * reorder_atol(torch.float32, terms, logits.abs().max().item())
    bound += reorder_atol(torch.float32, tokens, want)
    assert abs(got - want) <= bound, (got, want, bound)
    if not prefix:  # read after EOS instead, as this job's tasks were: nats off
        after_eos, _ = _task_nll(model, tmp_path, DocumentStart.of(BYTES, False, True))
        assert abs(after_eos - want) > 1.0
