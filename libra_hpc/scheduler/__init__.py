"""C-MLFQ: causal tool-return routing of multi-turn trajectories, and its queue service."""
