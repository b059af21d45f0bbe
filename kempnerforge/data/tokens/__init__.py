"""Token files: the prepared-data format (tokens.bin, token_flags.bin, meta.json), its writer
and readers, sharded directories, token-id checks, and token files read from an object store.

Modules outside this folder import these names from here, never from its modules.
"""

from __future__ import annotations

from kempnerforge.data.tokens.output_dir import check_output_dir
from kempnerforge.data.tokens.shards import (
    Shard,
    check_shard_output,
    check_unsharded_output,
    prepared_dirs,
    read_parts,
)
from kempnerforge.data.tokens.store_tokens import StoreReads
from kempnerforge.data.tokens.token_file import (
    DTYPES,
    TOKENS_FILE,
    TokenFileWriter,
    is_complete,
    read_meta,
)
from kempnerforge.data.tokens.token_flags import (
    FLAGS_FILE,
    FLAGS_SHA_KEY,
    IGNORE_INDEX,
    is_masked,
    masked_targets,
)
from kempnerforge.data.tokens.token_ids import (
    check_token_ids,
    id_limit,
    scan_and_record,
    token_at_error,
)
from kempnerforge.data.tokens.token_stream import TokenStream

__all__ = [
    "DTYPES",
    "FLAGS_FILE",
    "FLAGS_SHA_KEY",
    "IGNORE_INDEX",
    "Shard",
    "StoreReads",
    "TOKENS_FILE",
    "TokenFileWriter",
    "TokenStream",
    "check_output_dir",
    "check_shard_output",
    "check_token_ids",
    "check_unsharded_output",
    "id_limit",
    "is_complete",
    "is_masked",
    "masked_targets",
    "prepared_dirs",
    "read_meta",
    "read_parts",
    "scan_and_record",
    "token_at_error",
]
