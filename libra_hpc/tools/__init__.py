"""Sandboxed tool execution and action-level orchestration of tool resources (not built yet)."""
