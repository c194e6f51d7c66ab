from kvstore.fleet_sim.cli import main

from kvstore.provenance import recorded

recorded(main, "fleet_sim")
