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
        import xgrammar as xgr

        from xllm_gen.runtime.engine.regex_limits import schema_regex_problems
        from xllm_gen.runtime.engine.schema_support import unenforced
        for i, t in enumerate(tools):          # the forced call's arguments follow the schema: all of it enforced
            if not any(t is f for f in forced):
                continue
            schema = t["function"].get("parameters") or {}
            problems = unenforced(schema)
            if problems:
                raise APIError(f"tools[{i}].function.parameters: JSON schema keyword(s) the grammar backend does not "
                               f"enforce (the call could break them): {'; '.join(problems)}", param="tools")
            problems = schema_regex_problems(schema, xgr.Grammar.from_regex)     # before the grammar is built
            if problems:
                raise APIError(f"tools[{i}].function.parameters: {'; '.join(problems)}", param="tools")
        try:
            ebnf = parser.grammar(forced)
        except Exception as e:
            raise APIError(f"tools: cannot build the tool-call grammar: {e}", param="tools") from None
        from xllm_gen.runtime.engine.structured_outputs import StructuredOutputsParams
        params.structured_outputs = StructuredOutputsParams(grammar=ebnf)
    return tools, parser


def reply_message(text: str, reasoning=None, parser=None, opened: bool = False, truncated: bool = False,
                  include_reasoning: bool = True) -> dict:
    """The assistant message of a finished reply: content, and reasoning_content / tool_calls by the parsers
    (`opened`: the prompt opened the reasoning, reasoning.opened_by; `truncated`: the reply was cut by max_tokens,
    and an unfinished tool call in it is dropped; `include_reasoning` false: no reasoning_content)."""
    message: dict = {"role": "assistant", "content": text}
    if reasoning is not None:
        message["reasoning_content"], message["content"] = reasoning.extract(text, opened)
        if not include_reasoning:
            del message["reasoning_content"]
    if parser is not None and message["content"] is not None:
        content, calls = parser.extract(message["content"], truncated)
        if calls or truncated:
            message["content"] = content
        if calls:
            message["tool_calls"] = [call.openai() for call in calls]
    return message


def finish_reason(engine_reason, has_calls: bool):
    """OpenAI's finish_reason of a chat choice: "tool_calls" when it made calls and ended on its own; "length"
    when it was cut short (even after complete calls), as OpenAI's."""
    if has_calls and engine_reason not in (None, "length"):
        return "tool_calls"
    return engine_reason


def constrained_from_start(engine, so) -> bool:
    """The request's constraint holds from the reply's first token although a reasoning parser is on: the reasoning
    tags are not single tokens of the tokenizer, so the engine gives the reasoning no room
    (structured_outputs.reasoning_gate). Where the prompt opened the reasoning, the reply is then reasoning only if
    the constraint wrote the end tag, else content (calls / JSON): the parser's opened="maybe"."""
    if so is None or so.reasoning_tags is None or engine.tokenizer is None:
        return False
    from xllm_gen.runtime.engine.structured_outputs import reasoning_gate
    return reasoning_gate(engine.tokenizer, so.reasoning_tags, []) is None


class ReplySplitter:
    """One streamed choice: each text delta -> the chunk's delta (reasoning_content, content, tool_calls), text
    that may begin a tag held back until it is known; `calls_sent` counts the tool calls streamed."""

    def __init__(self, reasoning=None, parser=None, opened: bool = False, include_reasoning: bool = True):
        self.reasoning = reasoning.streamer(opened) if reasoning is not None else None
        self.tools = parser.streamer() if parser is not None else None
        self.include_reasoning = include_reasoning
        self.calls_sent = 0

    def feed(self, text: str, last: bool, truncated: bool = False) -> dict:
        """`last`: the choice's final delta; `truncated`: it was cut short (an unfinished tool call is dropped)."""
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
                c2, more = self.tools.finish(truncated)
                content, calls = content + c2, calls + more
        delta: dict = {}
        if r and self.include_reasoning:
            delta["reasoning_content"] = r
        if content:
            delta["content"] = content
        if calls:
            delta["tool_calls"] = [call.openai(self.calls_sent + k) for k, call in enumerate(calls)]
            self.calls_sent += len(calls)
        return delta
