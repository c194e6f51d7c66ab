"""The front door of an HTTP service, shared by kvstore-server and the engine's OpenAI server, P/D proxy
and router: what a connection may cost before a request reaches the middlewares (`connections`: the
connection limit, header timeout, JSON parser errors), the listener that applies it and hands a
connection to HTTP or the data plane (`listener`), the budget of request bodies held in memory
(`budget`) and the token-less Host/Origin rules (`origin`). It imports only the core's base and protocol
layers (docs/design.md §0), so that both rooms may import it."""
