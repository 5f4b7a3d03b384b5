"""The anonymous overlay and the peer transport under it: TLS peer links, onion paths through user
relays, S-IDA cloves, end-to-end messages, the verified directory of users and nodes, and a model node's
gateway into it."""
