"""Coordinator: node registry, planning (`plan/`), jobs (`job/`), Home Assistant (`homeassistant/`), the
service. Never imports torch."""
