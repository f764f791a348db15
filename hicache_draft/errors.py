"""Exceptions that cross the public API. Each message names what is wrong and what to do."""

from __future__ import annotations


class HiCacheDraftError(Exception):
    """Base class of every error hicache-draft raises on purpose."""


class ConfigError(HiCacheDraftError):
    """A configuration is invalid. ``field`` names the offending setting (dotted path)."""

    def __init__(self, message: str, field: str | None = None) -> None:
        super().__init__(message)
        self.field = field


class PluginError(HiCacheDraftError):
    """A backend plugin could not be loaded or failed validation."""


class UnknownBackendError(ConfigError):
    """The configured backend name is not an installed, loadable plugin."""


class BackendSetupError(HiCacheDraftError):
    """A backend could not start (unreachable service, unusable path, ...)."""
