"""Building genesis files and validator homes."""
