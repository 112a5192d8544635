"""The run dashboard: events in, panels and advisories out, one page to show them."""
