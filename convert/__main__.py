"""`python -m dflash_gguf.convert` runs dflash-convert."""

import sys

from dflash_gguf.convert.cli import main

sys.exit(main())
