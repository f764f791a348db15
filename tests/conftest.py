"""Shared pytest setup of the core tests."""

# The Mooncake store fixtures are opt-in; tests/test_controller_backends.py uses mooncake_options.
pytest_plugins = ["hicache_draft_mooncake.pytest_plugin"]
