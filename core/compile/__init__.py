"""The compiled whole-model FLUX call: config, shape policy, options, runner, telemetry, persistence (ARCHITECTURE.md)."""
