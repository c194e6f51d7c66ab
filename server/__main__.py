"""`python -m kvstore.server`: the same as `kvstore-server`."""

import sys

from kvstore.server.cli import main

sys.exit(main())
