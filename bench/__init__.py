"""Benchmarks: each runs with one command, measures side by side in one run,
prints ratios, writes bench/results/<name>.json and a plot."""
