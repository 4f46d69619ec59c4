"""``python -m gemport``: the command line."""

import sys

from gemport.cli import main

sys.exit(main())
