"""Context-length-aware parallelism selector and layout-aware data dispatch (EARL; not built yet)."""
