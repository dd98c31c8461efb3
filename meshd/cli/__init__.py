"""The `meshd` command line (meshd.cli.main), one module a concern: flag values, the commands, and
what a failure tells the user."""
