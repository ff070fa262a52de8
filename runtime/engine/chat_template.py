"""Chat templates and the messages they take, checked before anything is served.

`template_problem(text)` / `checkpoint_template_problem(dir)`: a template that does not compile (a Jinja syntax
error) is found once, at load, naming the file and the line (chat_template.jinja, additional_chat_templates/*.jinja,
tokenizer_config.json's or chat_template.json's chat_template: the one transformers reads), instead of failing every
chat request with a bare "unexpected '}'". The engine logs it and refuses chat while completions stay served; the
server refuses to start without --chat-template (engine.py, server.py).

`message_problem`: the messages a template gets. Any role string passes, as in transformers and vLLM (templates
define their own roles, and one that does not know a role raises its own error); a missing or null content is
refused where OpenAI refuses it (every role but an assistant's, whose tool-call turns carry none; vLLM renders it
as empty text, transformers hands the template None, which many render as the text "None"); an assistant's
tool_calls need OpenAI's shape (function.name; arguments as JSON text or an object), and text that is not valid
Unicode is named by its message, not by a character of the rendered prompt."""
from __future__ import annotations

import functools
import json
from pathlib import Path
from typing import Any, Optional

# roles whose content may be null (OpenAI: an assistant turn with tool_calls, a legacy function result)
CONTENT_OPTIONAL_ROLES = frozenset({"assistant", "function"})


def template_problem(text: Any) -> Optional[str]:
    """"line N: reason" when `text` does not compile as transformers compiles a chat template; None when it does
    (or when transformers' compiler is not available: the first chat reports it then)."""
    if not isinstance(text, str):
        return f"a chat template is text, got {type(text).__name__}"
    try:
        import jinja2
        from transformers.utils.chat_template_utils import _compile_jinja_template
    except ImportError:
        return None
    try:
        _compile_jinja_template(text)         # cached by transformers: the first chat reuses it
    except jinja2.TemplateSyntaxError as e:
        return f"line {e.lineno}: {e.message}"
    except jinja2.TemplateError as e:
        return str(e)
    return None


@functools.lru_cache(maxsize=64)
def takes_content_parts(text: Any) -> bool:
    """Whether a chat template reads a message's content as OpenAI's list of parts (it loops over
    `message.content` / `message['content']`: vLLM's "openai" content format), else as a string (vLLM's "string"
    format: a message's text parts reach it joined by newlines). Found from the template's syntax tree, as vLLM
    does; a template that does not parse is taken as a string one."""
    if not isinstance(text, str):
        return False
    try:
        from jinja2 import nodes
        from transformers.utils.chat_template_utils import _compile_jinja_template
        tree = _compile_jinja_template(text).environment.parse(text)
    except Exception:
        return False

    def names(node) -> set:
        return {n.name for n in ([node] if isinstance(node, nodes.Name) else []) + list(node.find_all(nodes.Name))}

    def targets(node) -> set:
        return {n.name for n in ([node] if isinstance(node, nodes.Name) else node.find_all(nodes.Name))}

    def reads_content(node, holders: set) -> bool:      # message.content / message['content'] in `node`
        for n in [node, *node.find_all((nodes.Getattr, nodes.Getitem))]:
            if isinstance(n, nodes.Getattr) and n.attr == "content" and names(n.node) & holders:
                return True
            if isinstance(n, nodes.Getitem) and isinstance(n.arg, nodes.Const) and n.arg.value == "content" \
                    and names(n.node) & holders:
                return True
        return False

    lists, messages, contents = {"messages"}, set(), set()
    for _ in range(4):               # names bound from the messages (loop_messages = messages[1:]), their items,
        for n in tree.find_all(nodes.Assign):             # and their content (content = message.content)
            if names(n.node) & lists and not reads_content(n.node, messages):
                lists |= targets(n.target)
            elif reads_content(n.node, messages):
                contents |= targets(n.target)
        for n in tree.find_all(nodes.For):
            if names(n.iter) & lists and not reads_content(n.iter, messages):
                messages |= targets(n.target)
    return any(reads_content(n.iter, messages) or (isinstance(n.iter, nodes.Name) and n.iter.name in contents)
               for n in tree.find_all(nodes.For))


def template_of(renderer, chat_template: Optional[str], tools: Any = None) -> Optional[str]:
    """The template text transformers renders with: `chat_template` (the text, or the name of one of the
    renderer's named templates), else the renderer's own ("tool_use" of named ones when tools are given)."""
    own = getattr(renderer, "chat_template", None)
    if isinstance(own, dict):
        if chat_template in own:
            return own[chat_template]
        if chat_template is None:
            return own.get("tool_use") if tools and "tool_use" in own else own.get("default")
    return chat_template if chat_template is not None else own if isinstance(own, str) else None


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None                           # read_json at load names a corrupt file; not this check's job


def checkpoint_templates(directory: Path) -> list[tuple[str, Any]]:
    """(where, template text) of each chat template the tokenizer / processor of `directory` reads, in
    transformers' order: chat_template.jinja and additional_chat_templates/*.jinja win over tokenizer_config.json's
    chat_template (a string or a list of {"name", "template"}); a processor's legacy chat_template.json after."""
    d = Path(directory)
    out: list[tuple[str, Any]] = []
    jinja = d / "chat_template.jinja"
    extra = sorted((d / "additional_chat_templates").glob("*.jinja")) if (d / "additional_chat_templates").is_dir() \
        else []
    for path in ([jinja] if jinja.is_file() else []) + extra:
        out.append((str(path), path.read_text(encoding="utf-8", errors="replace")))
    if not out:
        cfg = _read_json(d / "tokenizer_config.json") if (d / "tokenizer_config.json").is_file() else None
        t = cfg.get("chat_template") if isinstance(cfg, dict) else None
        where = f"{d / 'tokenizer_config.json'}'s chat_template"
        if isinstance(t, list):
            out += [(f"{where} {e.get('name')!r}", e.get("template")) for e in t if isinstance(e, dict)]
        elif t is not None:
            out.append((where, t))
    if not jinja.is_file() and (d / "chat_template.json").is_file():
        legacy = _read_json(d / "chat_template.json")
        if isinstance(legacy, dict) and "chat_template" in legacy:
            out.append((f"{d / 'chat_template.json'}'s chat_template", legacy["chat_template"]))
    return out


def checkpoint_template_problem(*directories: Path) -> Optional[str]:
    """"<file>, line N: reason" of the first chat template of these dirs (the tokenizer's, the checkpoint's) that
    does not compile; None when all do (or there is none)."""
    seen = set()
    for d in directories:
        if d is None or Path(d).resolve() in seen:
            continue
        seen.add(Path(d).resolve())
        for where, text in checkpoint_templates(Path(d)):
            problem = template_problem(text)
            if problem:
                return f"{where}, {problem}"
    return None


def message_problem(where: str, message: Any) -> Optional[str]:
    """Why one chat message (a dict in OpenAI's shape) cannot go to a template, or None."""
    if not isinstance(message, dict):
        return f"{where} must be a dict with 'role' and 'content', got {type(message).__name__}"
    role = message.get("role")
    if not isinstance(role, str) or not role:
        return f"{where}.role must be a non-empty string, got {role!r}"
    content = message.get("content")
    if content is None and role not in CONTENT_OPTIONAL_ROLES:
        return (f"{where}.content is {'null' if 'content' in message else 'missing'}: a {role!r} turn needs content "
                "(a string or a list of content parts); only an assistant turn may leave it out")
    if content is not None and not isinstance(content, (str, list)):
        return f"{where}.content must be a string or a list of content parts, got {type(content).__name__}"
    texts = [(f"{where}.content", content)] if isinstance(content, str) else [
        (f"{where}.content[{k}].text", part.get("text")) for k, part in enumerate(content or ())
        if isinstance(part, dict) and isinstance(part.get("text"), str)]
    for at, text in texts:                    # named here, not as a character of the rendered prompt
        bad = _surrogate_at(text)
        if bad is not None:
            return f"{at}: not valid Unicode (a lone surrogate at character {bad})"
    if message.get("tool_calls") is not None:
        return _tool_calls_problem(f"{where}.tool_calls", message["tool_calls"])
    return None


def _surrogate_at(text: str) -> Optional[int]:
    if text.isascii():
        return None
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        return e.start
    return None


def _tool_calls_problem(where: str, calls: Any) -> Optional[str]:
    """Why an assistant turn's tool_calls (OpenAI's shape) cannot go to a template, or None: each is
    {"id"?, "type": "function"?, "function": {"name": non-empty string, "arguments": JSON text or an object}}
    (a template reads function.name and the arguments; without them it fails naming no message)."""
    if not isinstance(calls, list):
        return f"{where} must be a list of tool calls, got {type(calls).__name__}"
    for j, call in enumerate(calls):
        at = f"{where}[{j}]"
        if not isinstance(call, dict) or not isinstance(call.get("function"), dict):
            return (f"{at}: a tool call is {{'id': ..., 'type': 'function', 'function': {{'name': ..., "
                    f"'arguments': ...}}}}, got {json.dumps(call, default=repr)[:60]}")
        if call.get("type", "function") != "function":
            return f"{at}.type must be 'function', got {call.get('type')!r}"
        name = call["function"].get("name")
        if not isinstance(name, str) or not name:
            return f"{at}.function.name must be a non-empty string, got {name!r}"
        args = call["function"].get("arguments")
        if args is not None and not isinstance(args, (str, dict)):
            return f"{at}.function.arguments must be a JSON string (or an object), got {type(args).__name__}"
    return None
