"""Helpers shared by the test suites: trainer processes, tiny models, engines, fakes named as such.

pytest puts ``tests/`` on ``sys.path`` (``pythonpath`` in pyproject), so tests ``import _support.x``; the
trainer scripts here also run as processes (``python tests/_support/model_trainer.py ...``).
"""
