"""kvstore server room (see DESIGN.md)."""
