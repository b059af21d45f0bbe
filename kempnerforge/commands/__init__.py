"""The command-line commands, one module each (train, eval, prepare-data, generate, capture,
export and import-hf, plot, check-parallel): each parses its arguments and calls library
functions. kempnerforge/cli.py lists them in one table."""
