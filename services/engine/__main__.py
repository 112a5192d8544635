"""Entry point: `python -m services.engine --model PATH --port N`."""

import sys

from services.engine.cli import main

sys.exit(main())
