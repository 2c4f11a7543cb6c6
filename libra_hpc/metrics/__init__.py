"""The run's log folder: JSON-lines events and metrics."""
