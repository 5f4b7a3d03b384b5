"""The replicated state machine (ABCI server, store, handlers) and its client side (RPC, light client)."""
