"""The rollout service: async scheduler, engine fleet, weight-update coordination."""
