"""`python -m kvstore.engine` is `kvstore-engine`."""

import sys

from kvstore.engine.cli import main

sys.exit(main())
