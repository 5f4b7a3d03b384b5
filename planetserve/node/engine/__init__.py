"""Serving engines behind one interface: the built-in torch engine and an OpenAI-compatible server."""
