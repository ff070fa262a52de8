"""Reasoning written as <think> ... </think> at the start of the reply (the `think` parser)."""
from xllm_gen.runtime.serving.reasoning_parsers import ThinkTagParser, register


@register("think")
class ThinkReasoningParser(ThinkTagParser):
    start = "<think>"
    end = "</think>"
