"""Controller loop (rank 0) and worker loop (ranks >= 1)."""
