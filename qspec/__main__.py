"""`python -m qspec ...` (and `torchrun ... -m qspec ...`): the qspec command."""

import sys

from .cli import main

sys.exit(main())
