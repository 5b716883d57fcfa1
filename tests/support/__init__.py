"""Helpers and fixtures shared by the tests (not shipped with the plugin)."""
