"""Helpers for tests, benchmarks and demos: tiny local models and an in-process vLLM scheduler."""
