"""ckpt package (under construction)."""
