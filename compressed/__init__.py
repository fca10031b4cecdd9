"""compressed package (under construction)."""
