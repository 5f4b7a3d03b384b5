"""The overlay: model nodes, serving engines, HR-tree forwarding and cache-state sync."""
