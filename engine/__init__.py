"""kvstore engine room (see DESIGN.md)."""
