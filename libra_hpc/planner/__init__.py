"""Global resource planner, cost models, replanning gate and the elastic hybrid pool (pure logic; not built yet)."""
