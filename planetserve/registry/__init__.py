"""The registry domain: entities, parameters and the pure rules over them (no I/O, no clock)."""
