"""The OpenAI-compatible HTTP API that model nodes and user relays serve: its requests and responses,
the one aiohttp surface both roles answer through, and the server that answers from an engine."""
