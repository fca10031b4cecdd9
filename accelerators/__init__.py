"""accelerators package (under construction)."""
