"""kvstore sdk room (see DESIGN.md)."""
