"""Agentic tasks: multi-turn environments with tools and verifiers (not built yet)."""
