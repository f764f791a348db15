"""Benchmarks that print ratios against a baseline measured in the same run (absolute GB/s only
mean something on the machine they ran on). Nothing heavy is imported until a benchmark runs."""
