"""The HTTP front door: the OpenAI and Anthropic APIs and the console, on any member."""
