"""Markers of the real-SGLang cases (this file imports nothing from SGLang: the parent suite loads it
too while collecting ``tests/``, and collects no case from this folder)."""


def pytest_configure(config):
    config.addinivalue_line("markers", "smoke: the cases every covered SGLang release runs")
