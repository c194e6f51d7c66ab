"""`python -m engine` is `kvstore-engine`."""

import sys

from engine.cli import main

sys.exit(main())
