"""The streaming-input session API (Mode B of the RFC)."""
