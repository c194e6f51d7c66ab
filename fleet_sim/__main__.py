from kvstore.fleet_sim.cli import main

from benchmarks.provenance import recorded

recorded(main, "fleet_sim")
