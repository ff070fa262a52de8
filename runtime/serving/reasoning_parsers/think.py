"""<think> ... </think> reasoning (Qwen3, QwQ, DeepSeek-R1 style outputs)."""
from xllm_gen.runtime.serving.reasoning_parsers import ThinkTagParser, register


@register("qwen3")
class Qwen3ReasoningParser(ThinkTagParser):
    start = "<think>"
    end = "</think>"
