"""A user module that fails while it is imported (a test fixture)."""

RATIO = 1 / 0
