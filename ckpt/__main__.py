"""Entry point: python -m ckpt inspect|verify PATH."""
import sys

from .cli import main

sys.exit(main())
