"""`python -m meshd.cli`: the command line, as the tests and tools start daemons."""

import sys

from meshd.cli.main import main

if __name__ == "__main__":
    sys.exit(main())
