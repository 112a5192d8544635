"""The sandbox service: terminal-bench-2 episodes in Daytona or local sandboxes."""
