"""Other vendors' APIs translated onto OpenAI chat completions: Anthropic's Messages API and
OpenAI's Responses API (with its response store).

Nothing here knows the engine or HTTP serving: the server (in process) and the gateway (over
HTTP) both run the chat completion the translation asks for and hand its answer back to be
translated. See docs/ANTHROPIC.md and docs/RESPONSES.md.
"""
