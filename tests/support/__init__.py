"""Helpers of the test suite, one module a concern; conftest.py holds only pytest's own hooks and fixtures."""
