"""Interoperability with other ecosystems: Hugging Face model folders (export and import),
and lm-evaluation-harness.

Start with kempnerforge.interop.hf (export_hf, import_hf, load_hf_into), which asks the
wing architectures/ (one module per Hugging Face architecture, and their registry); the
command-line side is kempnerforge.commands.hf. kempnerforge.interop.lm_eval is the
harness's model "kempnerforge" over a checkpoint (the optional lm-eval extra; nothing
imports it here).
"""
