"""Measuring: the side-by-side benchmark, fidelity metrics, the chart and the result files."""
