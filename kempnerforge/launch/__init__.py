"""Starting training processes: the host memory allocator a run is (re)started with, and
the runs of several parallel layouts that check-parallel compares."""
