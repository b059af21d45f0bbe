"""What the inference commands share (eval, generate, capture, export): loading a
checkpoint's model and its config in one process, the held-out data of an eval, the
prompts of generate, and the layer outputs of capture. It sits above training/'s own files,
which never import it; the commands do."""

from __future__ import annotations

from kempnerforge.training.inference.capture import (
    capture,
    capture_dataset,
    resolve_modules,
    save_capture,
)
from kempnerforge.training.inference.chat_prompt import chat_prompt, read_conversation
from kempnerforge.training.inference.eval_checkpoint import (
    build_eval_data,
    evaluate_checkpoint,
    evaluate_checkpoint_tasks,
    format_table,
    format_task_table,
    load_checkpoint_tasks,
    write_report,
)
from kempnerforge.training.inference.loading import (
    load_for_inference,
    open_for_inference,
    output_path,
)
from kempnerforge.training.inference.prompt import generation_prompt
from kempnerforge.training.inference.sample import print_sample

__all__ = [
    "build_eval_data",
    "capture",
    "capture_dataset",
    "chat_prompt",
    "evaluate_checkpoint",
    "evaluate_checkpoint_tasks",
    "format_table",
    "format_task_table",
    "generation_prompt",
    "load_checkpoint_tasks",
    "load_for_inference",
    "open_for_inference",
    "output_path",
    "print_sample",
    "read_conversation",
    "resolve_modules",
    "save_capture",
    "write_report",
]
