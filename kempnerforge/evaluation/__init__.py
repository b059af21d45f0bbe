"""Downstream evaluation tasks: their file format, converters from public sets, scoring."""
