"""A discrete-event simulator of a kvstore fleet (engines, kvstore-servers, a shared Valkey Cluster tier
and `kvstore-engine router`'s scoring) driven by the Mooncake traces; see the README's "Fleet simulator"
section and fleet_sim/cli.py."""
