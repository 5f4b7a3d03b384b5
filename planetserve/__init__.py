"""planetserve: decentralized, privacy-preserving LLM serving on a CometBFT verification ledger."""

__version__ = "0.1.0"
