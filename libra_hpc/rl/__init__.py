"""Trajectories, rewards, GRPO advantages and loss, staleness bound (not built yet)."""
