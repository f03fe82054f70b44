"""Coordinator: node registry, planning (`plan/`), jobs (`job/`), Home Assistant, the service. Never imports
torch."""
