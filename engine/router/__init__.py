"""`kvstore-engine router`: KV-aware routing over several engines (engine.router.app), or, with
`--prefill`/`--decode`, the disaggregated prefill/decode proxy (engine.proxy)."""
