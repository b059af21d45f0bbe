"""The job directory `kempnerforge train CONFIG [overrides]` would use (train.run_dir, or
runs/<train.name>), printed for job scripts: ft_groups.sbatch sizes the lighthouse's join
timeout from the step times its groups logged there.

    python -m kempnerforge.launch.job_dir CONFIG [--section.field=value ...]

A config that does not load is one line on stderr and exit code 2, as `train` reports it.
"""

from __future__ import annotations

import sys

from kempnerforge.config.loader import load_config
from kempnerforge.core.errors import ConfigError


def main(argv: list[str] | None = None) -> int:
    arguments = sys.argv[1:] if argv is None else argv
    if not arguments:
        print("usage: python -m kempnerforge.launch.job_dir CONFIG [overrides]", file=sys.stderr)
        return 2
    try:
        config = load_config(arguments[0], arguments[1:])
    except ConfigError as error:
        print(f"kempnerforge: error: {error}", file=sys.stderr)
        return 2
    print(config.job_dir)
    return 0


if __name__ == "__main__":
    sys.exit(main())
