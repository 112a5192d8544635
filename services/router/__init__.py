"""The router: picks an engine and dp rank for every generate call."""
