"""A chat reply's tools and parts: which tools the template renders and which grammar forces a call
(`plan_tools`, from `tools` / `tool_choice`), and the split of the reply's text into reasoning_content, content
and tool_calls, whole (`reply_message`) or as it streams (`ReplySplitter`), by the server's reasoning and
tool-call parsers (reasoning_parsers/, tool_parsers/)."""
from __future__ import annotations

from xllm_gen.runtime.serving import tool_parsers
from xllm_gen.runtime.serving.protocol import APIError


def plan_tools(body, params, tools_cls) -> tuple:
    """(the tools the template renders, the tool parser of the reply or None) for tools / tool_choice; for
    "required" or a named function, params.structured_outputs becomes the parser's grammar of one call."""
    choice = body.tool_choice
    if not body.tools:
        if choice not in (None, "none"):
            raise APIError("tool_choice needs tools", param="tool_choice")
        return None, None
    try:
        tools = tool_parsers.check_tools(body.tools)
    except ValueError as e:
        raise APIError(str(e), param="tools") from None
    if choice is None:
        choice = "auto"
    if choice == "none":
        return None, None
    if isinstance(choice, dict):
        fn = choice.get("function") if choice.get("type") == "function" else None
        name = fn.get("name") if isinstance(fn, dict) else None
        if not isinstance(name, str):
            raise APIError("tool_choice is 'none', 'auto', 'required' or {'type': 'function', 'function': "
                           "{'name': ...}}", param="tool_choice")
        forced = [t for t in tools if t["function"]["name"] == name]
        if not forced:
            raise APIError(f"tool_choice names {name!r}, which is not among the tools "
                           f"({', '.join(t['function']['name'] for t in tools)})", param="tool_choice")
    elif choice == "required":
        forced = tools
    elif choice == "auto":
        forced = None
    else:
        raise APIError(f"tool_choice must be 'none', 'auto', 'required' or a named function, got {choice!r}",
                       param="tool_choice")
    if tools_cls is None:
        raise APIError(f"tool_choice {choice if isinstance(choice, str) else 'with a named function'} needs a "
                       "tool-call parser: start the server with --tool-call-parser (e.g. hermes)",
                       param="tool_choice")
    parser = tools_cls(tools)
    if forced is not None:
        if params.structured_outputs is not None:
            raise APIError("response_format / structured_outputs cannot be combined with tool_choice "
                           "'required' or a named function", param="tool_choice")
        from xllm_gen.runtime.engine.schema_support import unenforced
        for i, t in enumerate(tools):          # the forced call's arguments follow the schema: all of it enforced
            problems = unenforced(t["function"].get("parameters") or {}) if any(t is f for f in forced) else ()
            if problems:
                raise APIError(f"tools[{i}].function.parameters: JSON schema keyword(s) the grammar backend does not "
                               f"enforce (the call could break them): {'; '.join(problems)}", param="tools")
        try:
            ebnf = parser.grammar(forced)
        except Exception as e:
            raise APIError(f"tools: cannot build the tool-call grammar: {e}", param="tools") from None
        from xllm_gen.runtime.engine.structured_outputs import StructuredOutputsParams
        params.structured_outputs = StructuredOutputsParams(grammar=ebnf)
    return tools, parser


def reply_message(text: str, reasoning=None, parser=None, opened: bool = False) -> dict:
    """The assistant message of a finished reply: content, and reasoning_content / tool_calls by the parsers
    (`opened`: the prompt opened the reasoning, reasoning.opened_by)."""
    message: dict = {"role": "assistant", "content": text}
    if reasoning is not None:
        message["reasoning_content"], message["content"] = reasoning.extract(text, opened)
    if parser is not None and message["content"] is not None:
        content, calls = parser.extract(message["content"])
        if calls:
            message["content"] = content
            message["tool_calls"] = [call.openai() for call in calls]
    return message


class ReplySplitter:
    """One streamed choice: each text delta -> the chunk's delta (reasoning_content, content, tool_calls), text
    that may begin a tag held back until it is known; `calls_sent` counts the tool calls streamed."""

    def __init__(self, reasoning=None, parser=None, opened: bool = False):
        self.reasoning = reasoning.streamer(opened) if reasoning is not None else None
        self.tools = parser.streamer() if parser is not None else None
        self.calls_sent = 0

    def feed(self, text: str, last: bool) -> dict:
        r, content = "", text
        if self.reasoning is not None:
            r, content = self.reasoning.feed(text)
            if last:
                r2, c2 = self.reasoning.finish()
                r, content = r + r2, content + c2
        calls: list = []
        if self.tools is not None:
            content, calls = self.tools.feed(content)
            if last:
                c2, more = self.tools.finish()
                content, calls = content + c2, calls + more
        delta: dict = {}
        if r:
            delta["reasoning_content"] = r
        if content:
            delta["content"] = content
        if calls:
            delta["tool_calls"] = [call.openai(self.calls_sent + k) for k, call in enumerate(calls)]
            self.calls_sent += len(calls)
        return delta
