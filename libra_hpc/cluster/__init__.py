"""Slurm/MPI world: environment, topology, layouts, communicator splits, submission."""
