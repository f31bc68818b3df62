"""``python -m sparse_attn`` = the ``sparse-attn`` command."""

import sys

from sparse_attn.cli import main

if __name__ == "__main__":
    sys.exit(main())
