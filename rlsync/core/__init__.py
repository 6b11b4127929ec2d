"""Framework-free mechanisms: layouts, planner, tensor store, versions, buffer, gating, hooks.

Imports torch and numpy only; never a training framework or an inference engine.
"""
