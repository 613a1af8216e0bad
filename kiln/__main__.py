"""`python -m kiln ...`: the same as the `kiln` command.

Depends on kiln.cli only.
"""

import sys

from kiln.cli import main

sys.exit(main())
