"""`kvstore-engine router`: KV-aware routing over several engines (kvstore.engine.router.app), or, with
`--prefill`/`--decode`, the disaggregated prefill/decode proxy (kvstore.engine.proxy)."""
