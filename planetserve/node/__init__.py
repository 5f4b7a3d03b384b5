"""Model nodes and user relays, in wings: engine/ (serving engines), api/ (the OpenAI-compatible HTTP
API), overlay/ (the anonymous overlay and peer transport), routing/ (HR-tree forwarding and cache-state
sync), pipeline/ (layer pipelines); the roles on top (docs/architecture.md, "node/ wings")."""
