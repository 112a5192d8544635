"""`python -m services.slurm --config FILE`: run a deployment as srun steps in this job."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from services.common.errors import RiptideError


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m services.slurm", description=__doc__)
    parser.add_argument("--config", required=True, type=Path, help="deployment TOML file")
    args = parser.parse_args(argv)
    from services.deployment import load_config
    from services.slurm.supervisor import run

    try:
        return run(load_config(args.config), args.config.resolve())
    except RiptideError as exc:
        print(f"riptide slurm: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
