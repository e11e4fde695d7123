"""The sidecar process: `python -m pdwatch.sidecar [flags]`, the same `main` that `pdwatch serve` runs.

Its entry point sits in its own layer, so what runs a sidecar from below the
CLI (the testbed) starts it here rather than through the `pdwatch` command.
"""

import sys

from .server import main

sys.exit(main())
