"""Interoperability with other ecosystems: Hugging Face model folders (export and import).

Start with kempnerforge.interop.hf (export_hf, import_hf, load_hf_into); the command-line
side is kempnerforge.commands.hf.
"""
