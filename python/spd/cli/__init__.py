"""The command line (`python -m spd ...`, `spd ...`): one module per subcommand."""
from spd.cli.main import main

__all__ = ["main"]
