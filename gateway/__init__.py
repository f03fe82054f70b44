"""Coordinator: node registry, cost model, planner, job state machine. Never imports torch."""
