"""TEXT: the decoder-only language model of model.* (dense or MoE) on token windows."""

from __future__ import annotations

import torch

from kempnerforge.config.data import DataConfig
from kempnerforge.config.eval import EvalSetConfig
from kempnerforge.config.model import ModelConfig
from kempnerforge.config.train import TrainConfig
from kempnerforge.data.pipeline import NO_TOKEN_EVAL_DATA, DataPipeline
from kempnerforge.data.pipeline_build import build_data_pipeline
from kempnerforge.data.tokenizer import Tokenizer
from kempnerforge.distributed.runtime import RuntimeContext
from kempnerforge.model import generate_greedy
from kempnerforge.model.transformer import Transformer, build_model
from kempnerforge.model.transformer import flops_per_token as model_flops_per_token
from kempnerforge.training.families.family import (
    ModelFamily,
    ModelSummary,
    sliced_for_context_parallel,
)
from kempnerforge.training.forward import text_batch_loss_fn
from kempnerforge.training.freeze import NO_FREEZE
from kempnerforge.training.session import StepResult
from kempnerforge.training.steps import text_step


def build_token_data(
    data: DataConfig,
    train: TrainConfig,
    eval_sets: list[EvalSetConfig],
    model_vocab_size: int,
    runtime: RuntimeContext,
    with_train: bool,
) -> DataPipeline:
    """Token windows of data.*, and the eval sets (eval.sets, or the held-out split)."""
    pipeline = build_data_pipeline(
        data,
        seq_len=train.seq_len,
        batch_size=train.batch_size,
        seed=train.seed,
        dp_rank=runtime.dp_rank,
        dp_size=runtime.dp_size,
        model_vocab_size=model_vocab_size,
        with_train=with_train,
        eval_sets=eval_sets,
    )
    return sliced_for_context_parallel(pipeline, runtime)


def summarize_text_model(model: ModelConfig, seq_len: int) -> ModelSummary:
    """Every parameter the config builds (all experts of an MoE model), from the config, so
    a sharded or pipelined rank logs the whole model; FLOPs per token at train.seq_len
    count an MoE block's active experts only."""
    return ModelSummary(
        num_params=model.num_params(), flops_per_token=model_flops_per_token(model, seq_len)
    )


def text_tokens_per_step(train: TrainConfig, dp_size: int, result: StepResult) -> int:
    """Every position of every sequence of the step, over the data-parallel ranks."""
    del result
    return train.batch_size * train.seq_len * train.grad_accum_steps * dp_size


def prompt_ids(tokenizer: Tokenizer, prompt: str, bos_per_document: bool) -> list[int]:
    """The prompt's ids, after a BOS when the training documents started with one, so the
    model continues a document the way it saw documents begin."""
    ids = tokenizer.encode(prompt)
    return [tokenizer.bos_id, *ids] if bos_per_document else ids


def continue_prompt(model: torch.nn.Module, data: DataPipeline, train: TrainConfig) -> str | None:
    """A greedy continuation of train.sample_prompt, train.sample_tokens long; None when
    either is empty. generate_greedy decodes on the device the model is on."""
    if not train.sample_prompt or train.sample_tokens == 0:
        return None
    tokenizer = data.tokenizer
    new_ids = generate_greedy(
        model,
        prompt_ids(tokenizer, train.sample_prompt, data.bos_per_document),
        max_new_tokens=train.sample_tokens,
        max_seq_len=train.seq_len,
        stop_id=tokenizer.eos_id,
    )
    return train.sample_prompt + tokenizer.decode(new_ids)


def fill_text_unsaved(model: Transformer) -> None:
    """What a text checkpoint does not hold: the tied head, the RoPE tables."""
    model.tie_head()
    model.reset_buffers()


TEXT = ModelFamily(
    name="text",
    build_model=lambda config: build_model(config.model),
    build_data=lambda config, runtime, with_train: build_token_data(
        config.data, config.train, config.eval.sets, config.model.vocab_size, runtime, with_train
    ),
    step=text_step,
    batch_loss=lambda config: text_batch_loss_fn(config.data.document_masking),
    sample=lambda model, data, config, device: continue_prompt(model, data, config.train),
    summarize=lambda config, model: summarize_text_model(config.model, config.train.seq_len),
    tokens_per_step=text_tokens_per_step,
    freeze_schedule=lambda config: NO_FREEZE,
    checkpoint_extra=lambda config, step: {},
    no_eval_data=NO_TOKEN_EVAL_DATA,
    fill_unsaved=fill_text_unsaved,
)
