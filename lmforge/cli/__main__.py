"""`python -m lmforge.cli VERB ...`, and `torchrun ... -m lmforge.cli pretrain ...` on every
rank."""

import sys

from lmforge.cli import main

sys.exit(main())
