"""`python -m server`: the same as `kvstore-server`."""

import sys

from server.cli import main

sys.exit(main())
