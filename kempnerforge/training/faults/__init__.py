"""Faults within one launch: a bad step's attribution (bad data, a spike, a suspected
hardware fault, by running the step again), the rollback to the last checkpoint after
non-finite losses, and checkpoint saves that fail without ending the run. The loop calls
these and nothing else in training/ does; replica groups and the commands never do."""
