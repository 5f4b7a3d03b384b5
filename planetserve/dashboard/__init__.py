"""A live dashboard of a planetserve network, served to a browser by `planetserve dashboard`.

It reads the system the way its clients do: each validator's CometBFT RPC status, the ledger through
verified reads (`LedgerClient.verified`, trusting only the genesis file), and a user relay's status
endpoint; its chat box sends prompts through that relay's anonymous OpenAI-compatible endpoint.
`collect` gathers one snapshot, `server` serves the page (package data under `static/`) and its API.
It sits beside `node` and `verifier` and imports `chain` and `registry`; nothing imports it.
"""

HEALTH_PATH = "/api/health"
"""Answers 200 once the server listens (what `localnet up` waits for)."""
