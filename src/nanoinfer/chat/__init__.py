"""Chat answers as OpenAI's chat API gives them: reasoning split from content (reasoning.py) and tool calls parsed or
constrained (tool_calls.py)."""
