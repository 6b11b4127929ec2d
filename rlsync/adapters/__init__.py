"""Translation at the edges: trainer layouts, inference engines, RL frameworks."""
