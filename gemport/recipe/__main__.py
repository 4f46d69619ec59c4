"""``python -m gemport.recipe [PATH]``: record the installed TRL's and transformers' defaults (``owners.main``)."""

import sys

from gemport.recipe.owners import main

sys.exit(main())
