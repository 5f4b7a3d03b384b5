"""Where a model node's group serves a request: the chunk plan (Sentry), the HR-tree, the group's
cache-state sync, the load-balance factor and Algorithm 2, and the group's verified membership."""
