"""Benchmarks behind `deltaserve bench`: each prints measured figures next to a baseline."""
