"""`kvstore-engine router`: KV-aware routing over several engines (kvstore.engine.router.app), or, with
`--prefill`/`--decode`, the disaggregated prefill/decode proxy (kvstore.engine.proxy)."""

ROUTE_TOKENS = 16_384  # a prompt's leading tokens the router routes on (kvstore.engine.router.tokens)
