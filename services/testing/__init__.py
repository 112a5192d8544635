"""Test servers and fixtures shared by tests and benchmarks (not used in production)."""
