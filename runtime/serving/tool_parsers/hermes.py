"""Hermes-style tool calls (the `hermes` parser), as many chat templates ask for them:

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>
"""
from xllm_gen.runtime.serving.tool_parsers import TaggedJSONToolParser, register


@register("hermes")
class HermesToolParser(TaggedJSONToolParser):
    start = "<tool_call>"
    end = "</tool_call>"
