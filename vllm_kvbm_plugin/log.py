"""Loggers under vLLM's `vllm` logger, so our lines share its handler, format and level
(VLLM_LOGGING_LEVEL) without importing vLLM here."""

import logging


def get_logger(name: str) -> logging.Logger:
    return logging.getLogger(f"vllm.kvbm.{name}")
