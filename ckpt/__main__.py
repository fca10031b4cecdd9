"""Entry point: python -m ckpt inspect|verify|convert|export (see --help for exit codes)."""
import sys

from .cli import main

sys.exit(main())
