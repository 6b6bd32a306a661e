"""`python -m collector.cli`, as `python -m collector` and the `hami-usage` script."""

import sys

from . import main

sys.exit(main())
