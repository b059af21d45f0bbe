"""build_data_pipeline and build_image_text_pipeline: a job's tokenizer, training loader and
held-out data from [data] (and [vlm]) for one data-parallel rank, checked against the model."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from torch.utils.data import Dataset

from kempnerforge.config.data import DataConfig
from kempnerforge.config.eval import DEFAULT_EVAL_SET, EvalSetConfig
from kempnerforge.config.vlm import VisionSpec, VLMConfig
from kempnerforge.core.errors import ConfigError, DataError, DataPathError
from kempnerforge.core.logging import get_logger
from kempnerforge.data.builtin import builtin_corpus, default_cache_dir
from kempnerforge.data.chat import packing_mismatch
from kempnerforge.data.dataloader import TrainDataLoader, build_train_loader
from kempnerforge.data.dataset import MemoryMappedDataset
from kempnerforge.data.image_text import build_image_text_datasets
from kempnerforge.data.pipeline import DataPipeline
from kempnerforge.data.sampling import MixtureDataset, MixtureSampler, PairSampler, ShardedSampler
from kempnerforge.data.tokenizer import Tokenizer, load_tokenizer
from kempnerforge.data.tokens import StoreReads

logger = get_logger(__name__)

DatasetOpener = Callable[[str, str | None], MemoryMappedDataset]
"""Opens the prepared directory at a path; a problem names the config field (the second
argument) that gave the path, or re-raises as is when None (the built-in corpus)."""


def build_data_pipeline(
    cfg: DataConfig,
    *,
    seq_len: int,
    batch_size: int,
    seed: int,
    dp_rank: int = 0,
    dp_size: int = 1,
    model_vocab_size: int | None = None,
    with_train: bool = True,
    eval_sets: Sequence[EvalSetConfig] = (),
) -> DataPipeline:
    """Tokenizer, training loader and eval data for one data-parallel rank.

    ``cfg.path`` empty means the built-in corpus (prepared on first use, then cached), whose
    held-out split is the eval data unless ``cfg.eval_path`` names one. With ``cfg.path`` set
    and ``cfg.eval_path`` empty there is no eval data. ``eval_sets`` (the ``[[eval.sets]]``
    tables) replaces that one "heldout" set with named ones. Every dataset is checked against
    the tokenizer and ``model_vocab_size``, and so is the tokenizer itself (a ConfigError on
    model.vocab_size when its vocabulary is larger).

    ``cfg.datasets`` non-empty trains on that mixture instead (a MixtureDataset read by a
    MixtureSampler with ``cfg.mix_temperature``); like ``cfg.path`` it has no eval data
    unless ``cfg.eval_path`` or ``eval_sets`` gives some.
    """
    tokenizer = load_tokenizer(cfg.tokenizer)
    _check_builtin_bos(cfg, tokenizer)
    train_dir, eval_dir = _data_dirs(cfg, tokenizer, with_train, eval_sets)
    open_dataset = _dataset_opener(cfg, tokenizer, seq_len, model_vocab_size)
    dataset: MemoryMappedDataset | MixtureDataset | None = None
    sampler: ShardedSampler | MixtureSampler | None = None
    loader = None
    if with_train:
        dataset, sampler, loader = _open_token_train_data(
            cfg, train_dir, open_dataset, seq_len, batch_size, seed, dp_rank, dp_size
        )
    eval_datasets = _open_eval_datasets(cfg, eval_dir, eval_sets, open_dataset)
    check_tokenizer_fits(tokenizer, cfg.tokenizer, model_vocab_size)
    return DataPipeline(
        dataset=dataset,
        sampler=sampler,
        dataloader=loader,
        eval_datasets=eval_datasets,
        tokenizer=tokenizer,
        dp_rank=dp_rank,
        dp_size=dp_size,
        dataset_names=[source.name for source in cfg.datasets] if with_train else [],
        bos_per_document=_bos_per_document(dataset, eval_datasets),
    )


def _check_builtin_bos(cfg: DataConfig, tokenizer: Tokenizer) -> None:
    """A ConfigError on data.builtin_bos when the tokenizer's BOS is its EOS: a BOS per
    document would then be indistinguishable from the separator between documents."""
    if cfg.builtin_bos and tokenizer.bos_id == tokenizer.eos_id:
        raise ConfigError(
            "data.builtin_bos",
            True,
            "false with this tokenizer",
            f"{cfg.tokenizer} has no BOS token of its own (its BOS is its EOS)",
        )


def _data_dirs(
    cfg: DataConfig, tokenizer: Tokenizer, with_train: bool, eval_sets: Sequence[EvalSetConfig]
) -> tuple[str, str]:
    """The training and held-out directories: data.path and data.eval_path, or the built-in
    corpus's splits where no path is given and something would read them.

    The built-in corpus is prepared (once, then cached) only when it is read, so a job with
    its own data or its own eval sets never tokenises it.
    """
    train_dir, eval_dir = cfg.path, cfg.eval_path
    if eval_sets and cfg.eval_path:
        logger.warning(
            "data.eval_path = %r is ignored because eval.sets is given; add it as an "
            "[[eval.sets]] table to evaluate on it",
            cfg.eval_path,
        )
    needs_builtin_eval = not eval_sets and not cfg.eval_path
    if not cfg.path and not cfg.datasets and (with_train or needs_builtin_eval):
        builtin_train, builtin_eval = builtin_corpus(
            cfg.cache_dir or default_cache_dir(),
            tokenizer,
            cfg.builtin_eval_fraction,
            bos_per_document=cfg.builtin_bos,
        )
        train_dir, eval_dir = builtin_train, cfg.eval_path or builtin_eval
    return train_dir, eval_dir


def _dataset_opener(
    cfg: DataConfig, tokenizer: Tokenizer, seq_len: int, model_vocab_size: int | None
) -> DatasetOpener:
    """Opens prepared directories checked against this job's tokenizer and model, so every
    training and eval set is read with the same windows and the same checks (and those in
    an object store with data.store_read_ahead_mb and data.store_cache_gb)."""
    store = StoreReads(
        read_ahead_bytes=cfg.store_read_ahead_mb << 20,
        cache_dir=cfg.cache_dir or default_cache_dir(),
        cache_bytes=int(cfg.store_cache_gb * 2**30),
    )

    def open_dataset(path: str, field: str | None) -> MemoryMappedDataset:
        """The dataset at ``path``; a problem names ``field``, the config field giving it
        (None for the built-in corpus, which no field names)."""
        try:
            dataset = MemoryMappedDataset(
                path,
                seq_len,
                document_masking=cfg.document_masking,
                expected_tokenizer=tokenizer.identity,
                model_vocab_size=model_vocab_size,
                store=store,
            )
        except DataError as e:
            if field is None:
                raise
            raise DataPathError(field, path, e) from None
        # Trains all the same, but some conversations lose their beginning: say so once.
        mismatch = packing_mismatch(path, dataset.meta, seq_len)
        if mismatch is not None:
            logger.warning("%s", mismatch)
        return dataset

    return open_dataset


def _open_token_train_data(
    cfg: DataConfig,
    train_dir: str,
    open_dataset: DatasetOpener,
    seq_len: int,
    batch_size: int,
    seed: int,
    dp_rank: int,
    dp_size: int,
) -> tuple[MemoryMappedDataset | MixtureDataset, ShardedSampler | MixtureSampler, TrainDataLoader]:
    """The training dataset (the data.datasets mixture, else the one at ``train_dir``), its
    sampler for this rank and the loader reading it."""
    dataset: MemoryMappedDataset | MixtureDataset
    sampler: ShardedSampler | MixtureSampler
    if cfg.datasets:
        dataset, sampler, train_dir = _open_mixture(cfg, open_dataset, dp_rank, dp_size, seed)
    else:
        dataset = open_dataset(train_dir, "data.path" if cfg.path else None)
        if is_preference(dataset.meta):
            check_pair_windows(train_dir, dataset.meta, seq_len)
            sampler = PairSampler(len(dataset), batch_size, dp_rank, dp_size, seed, cfg.shuffle)
        else:
            if is_prompts(dataset.meta):
                check_prompt_windows(train_dir, dataset.meta, seq_len)
            sampler = ShardedSampler(len(dataset), dp_rank, dp_size, seed, shuffle=cfg.shuffle)
    loader = _train_loader(
        dataset,
        sampler,
        batch_size,
        cfg.num_workers,
        seed,
        shortfall=f"{train_dir}: {len(dataset)} windows of {seq_len + 1} tokens",
        remedy="prepare more text or lower train.batch_size or train.seq_len",
        source=train_dir,
        contents=f"{dataset.num_tokens:,} tokens, {len(dataset):,} windows",
    )
    return dataset, sampler, loader


def _open_mixture(
    cfg: DataConfig, open_dataset: DatasetOpener, dp_rank: int, dp_size: int, seed: int
) -> tuple[MixtureDataset, MixtureSampler, str]:
    """The data.datasets mixture, its sampler at data.mix_temperature, and how the log and
    errors name it (each source's name and path)."""
    names = [source.name for source in cfg.datasets]
    sources = [
        open_dataset(source.path, f"data.datasets[{i}].path")
        for i, source in enumerate(cfg.datasets)
    ]
    dataset = MixtureDataset(sources, names)
    sampler = MixtureSampler(
        dataset.sizes,
        [source.weight for source in cfg.datasets],
        cfg.mix_temperature,
        dp_rank,
        dp_size,
        seed,
    )
    label = "mixture " + ", ".join(
        f"{name}={source.path}" for name, source in zip(names, cfg.datasets, strict=True)
    )
    return dataset, sampler, label


def _open_eval_datasets(
    cfg: DataConfig,
    eval_dir: str,
    eval_sets: Sequence[EvalSetConfig],
    open_dataset: DatasetOpener,
) -> dict[str, MemoryMappedDataset]:
    """The held-out sets by name: the [[eval.sets]] tables when given, else the one
    "heldout" set at ``eval_dir`` (if any)."""
    eval_datasets: dict[str, MemoryMappedDataset] = {}
    for i, eval_set in enumerate(eval_sets):
        eval_datasets[eval_set.name] = open_dataset(eval_set.path, f"eval.sets[{i}].path")
    if not eval_sets and eval_dir:
        field = "data.eval_path" if cfg.eval_path else None
        eval_datasets[DEFAULT_EVAL_SET] = open_dataset(eval_dir, field)
    return eval_datasets


def _train_loader(
    dataset: Dataset[Any],
    sampler: ShardedSampler | MixtureSampler,
    batch_size: int,
    num_workers: int,
    seed: int,
    *,
    shortfall: str,
    remedy: str,
    source: str,
    contents: str,
) -> TrainDataLoader:
    """The training loader, logged as ``source: contents`` with its batches per epoch.

    A DataError, opened by ``shortfall`` (the data and its size) and closed by ``remedy``,
    when a rank's share is less than one batch: the loader drops partial batches, so such a
    rank would never yield one.
    """
    if sampler.samples_per_rank < batch_size:
        raise DataError(
            f"{shortfall} give each of {sampler.dp_size} data-parallel ranks "
            f"{sampler.samples_per_rank}, fewer than one batch of {batch_size}; {remedy}"
        )
    loader = build_train_loader(dataset, sampler, batch_size, num_workers, seed)
    logger.info(
        "training data %s: %s, %d batches per epoch per rank",
        source,
        contents,
        sampler.samples_per_rank // batch_size,
    )
    return loader


def build_image_text_pipeline(
    cfg: DataConfig,
    vlm: VLMConfig,
    spec: VisionSpec,
    *,
    batch_size: int,
    seed: int,
    dp_rank: int = 0,
    dp_size: int = 1,
    model_vocab_size: int | None = None,
    with_train: bool = True,
    prefix_len: int = 0,
) -> DataPipeline:
    """A vision-language job's data: image-text pairs from vlm.data (or synthetic ones),
    tokenised with data.tokenizer, read in data.shuffle order by data.num_workers workers.

    The held-out sets come from vlm.eval_data (or the synthetic held-out set); [[eval.sets]]
    name prepared token directories, which a vision-language job does not read.
    ``prefix_len`` is the model's image tokens before the text (DataPipeline.prefix_len).
    """
    tokenizer = load_tokenizer(cfg.tokenizer)
    check_tokenizer_fits(tokenizer, cfg.tokenizer, model_vocab_size)
    dataset, eval_datasets = build_image_text_datasets(
        vlm, spec, tokenizer, seed, with_train=with_train
    )
    sampler = loader = None
    if dataset is not None:
        size = len(dataset)
        sampler = ShardedSampler(size, dp_rank, dp_size, seed, shuffle=cfg.shuffle)
        loader = _train_loader(
            dataset,
            sampler,
            batch_size,
            cfg.num_workers,
            seed,
            shortfall=f"{vlm.data or 'the synthetic image-text data'}: {size} pairs",
            remedy="add pairs (or raise vlm.synthetic_samples) or lower train.batch_size",
            source=vlm.data or "synthetic images",
            contents=f"{size:,} image-text pairs",
        )
    return DataPipeline(
        dataset=dataset,
        sampler=sampler,
        dataloader=loader,
        tokenizer=tokenizer,
        eval_datasets=eval_datasets,
        dp_rank=dp_rank,
        dp_size=dp_size,
        bos_per_document=True,
        prefix_len=prefix_len,
    )


def check_tokenizer_fits(tokenizer: Tokenizer, spec: str, model_vocab_size: int | None) -> None:
    """A ConfigError on model.vocab_size when the tokenizer (data.tokenizer = ``spec``) has
    more ids than the model's embedding; nothing to check without a model size."""
    if model_vocab_size is not None and tokenizer.vocab_size > model_vocab_size:
        raise ConfigError(
            "model.vocab_size",
            model_vocab_size,
            f">= the tokenizer's vocabulary size {tokenizer.vocab_size}",
            f"data.tokenizer = {spec!r}",
        )


def _bos_per_document(
    dataset: MemoryMappedDataset | MixtureDataset | None,
    eval_datasets: dict[str, MemoryMappedDataset],
) -> bool:
    """Whether the training documents start with BOS; warns where the data disagree.

    Disagreeing data still trains, but the model then sees two ways a document can start,
    and an eval set prepared the other way measures a slightly different task.
    """
    if isinstance(dataset, MixtureDataset):
        sources = zip(dataset.names, dataset.datasets, strict=True)
        train = {name: d.bos_per_document for name, d in sources}
    elif dataset is not None:
        train = {dataset.path: dataset.bos_per_document}
    else:
        train = {name: d.bos_per_document for name, d in eval_datasets.items()}
    if len(set(train.values())) > 1:
        with_bos = [name for name, bos in train.items() if bos]
        logger.warning(
            "training data mixes documents with and without a leading BOS (with: %s); "
            "prepare every source with or every source without prepare-data --bos",
            ", ".join(with_bos),
        )
    bos = all(train.values()) if train else False
    for name, eval_set in eval_datasets.items():
        if eval_set.bos_per_document != bos:
            logger.warning(
                "eval set %r (%s) was prepared %s a BOS per document, the training data %s",
                name,
                eval_set.path,
                "with" if eval_set.bos_per_document else "without",
                "with" if bos else "without",
            )
    return bos


def is_preference(meta: dict[str, Any]) -> bool:
    """Whether a prepared directory's meta.json is a preference corpus (--format preference)."""
    return meta.get("format") == "preference"


def is_prompts(meta: dict[str, Any]) -> bool:
    """Whether a prepared directory's meta.json is a prompts corpus (--format prompts)."""
    return meta.get("format") == "prompts"


def check_pair_windows(path: str, meta: dict[str, Any], seq_len: int) -> None:
    """A preference corpus is read one response per window: train.seq_len must be the
    --seq-len it was prepared with (DataError naming the directory otherwise)."""
    _check_prepared_windows(path, meta, seq_len, "a preference corpus", "one response")


def check_prompt_windows(path: str, meta: dict[str, Any], seq_len: int) -> None:
    """A prompts corpus is read one prompt and its answer per window: train.seq_len must be
    the --seq-len it was prepared with (DataError naming the directory otherwise)."""
    _check_prepared_windows(path, meta, seq_len, "a prompts corpus", "one prompt and its answer")


def _check_prepared_windows(
    path: str, meta: dict[str, Any], seq_len: int, corpus: str, holds: str
) -> None:
    prepared = meta.get("packed_seq_len")
    if prepared != seq_len:
        raise DataError(
            f"{path}: {corpus} prepared with --seq-len {prepared} holds {holds} per window of "
            f"{prepared} tokens, but train.seq_len is {seq_len}; train with "
            f"--train.seq_len={prepared} or prepare it again with --seq-len {seq_len}"
        )
