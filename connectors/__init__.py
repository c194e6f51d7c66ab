"""kvstore connectors room (docs/design.md §0, §5)."""
