"""The `meshd` command and `python -m meshd`: the command line, imported only once Ctrl-C can be
answered with its one line (importing it takes a second on a busy machine, and an interrupt then
printed a traceback)."""

import sys


def main() -> int:
    try:
        from meshd.cli.main import main as run_command
    except KeyboardInterrupt:
        print("meshd: interrupted", file=sys.stderr)
        return 130
    return run_command()


if __name__ == "__main__":
    sys.exit(main())
