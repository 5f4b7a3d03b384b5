"""Running a multi-validator network on one machine."""
