"""Scenario TOML files shipped with mhctool (installed as mhctool.scenarios)."""
