"""Model-family names of the server's output parsers (`xllm-gen-serve --reasoning-parser NAME`,
`--tool-call-parser NAME`), kept outside the model-agnostic runtime: each maps to a parser named by its
output format (runtime/serving/reasoning_parsers/, runtime/serving/tool_parsers/)."""

# family -> reasoning parser: Qwen3 replies open with <think> ... </think> (vLLM's name: qwen3)
REASONING_PARSERS = {"qwen3": "think"}

# family -> tool-call parser: Qwen2.5 / Qwen3 chat templates ask for Hermes-style <tool_call> JSON
TOOL_CALL_PARSERS = {"qwen3": "hermes", "qwen2_5": "hermes",
                     # Qwen3-Coder's template asks for XML function calls (vLLM's names: qwen3_coder, qwen3_xml)
                     "qwen3_coder": "xml_function", "qwen3_xml": "xml_function"}
