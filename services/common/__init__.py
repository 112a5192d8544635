"""Shared plumbing of the four services: config, gRPC and admin bootstrap, sample buffer."""
