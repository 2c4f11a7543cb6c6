"""Discrete-event simulator driving the same planner and scheduler objects (not built yet)."""
