import sys

from benchmarks.fleet_sim.cli import main

sys.exit(main())
