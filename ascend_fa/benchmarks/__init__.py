"""Benchmarks behind ``ascend-fa bench NAME``; each measures its baseline in-run."""
