"""Third-party agents run unchanged: Harbor's Terminus-2 and mini-swe-agent (see harness.py)."""
