"""Entry point: `python -m services.rollout.engine --model PATH --port N`."""

import sys

from services.rollout.engine.cli import main

sys.exit(main())
