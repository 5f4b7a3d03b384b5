"""A model served by a layer pipeline (Parallax): chain selection over the stages' layer ranges, the
stage servers, the coordinator that runs a request through a chain, the pipelined engine a model node
serves with, and how a node learns its stage from the ledger's deployment."""
