"""`python -m meshd`: the same as the `meshd` command."""

import sys

from meshd.cli import main

sys.exit(main())
