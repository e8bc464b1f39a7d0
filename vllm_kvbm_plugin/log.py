"""Loggers under vLLM's `vllm` logger, so our lines share its handler, format and level
(VLLM_LOGGING_LEVEL) without importing vLLM here."""

import logging
import re


def get_logger(name: str) -> logging.Logger:
    return logging.getLogger(f"vllm.kvbm.{name}")


def redact_url(url: object) -> str:
    """`url` as every log line and error of ours shows a server address: a password in its user
    part or query string replaced by `***` (the user name stays)."""
    text = str(url)
    scheme, sep, rest = text.partition("://")
    if not sep:
        return text
    end = min((i for i in (rest.find(c) for c in "/?#") if i >= 0), default=len(rest))
    netloc, tail = rest[:end], rest[end:]
    userinfo, at, host = netloc.rpartition("@")
    if at:
        user, colon, _ = userinfo.partition(":")
        netloc = f"{user}:***@{host}" if colon else f"***@{host}"
    tail = re.sub(r"(?i)([?&;]password=)[^&#;]*", r"\1***", tail)
    return f"{scheme}://{netloc}{tail}"
