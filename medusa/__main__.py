"""`python -m medusa <command>`: the same as the `medusa` command."""

from medusa.cli import main

main()
