"""kvstore server room (docs/design.md §0)."""
