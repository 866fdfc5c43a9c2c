"""The HTTP APIs (OpenAI, Anthropic) and what they share: request bodies, chat and tool
rendering, output constraints, generation from token ids to text, response assembly."""
