"""kvstore connectors room (see DESIGN.md)."""
