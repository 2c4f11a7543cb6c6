"""libra_hpc: Slurm-native agentic RL post-training with Libra-style resource management."""

from libra_hpc.config import ConfigError, ExperimentConfig, load_config

__all__ = ["ConfigError", "ExperimentConfig", "load_config"]
__version__ = "0.1.0"
