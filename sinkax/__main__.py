"""``python -m sinkax train``: the :mod:`sinkax.cli` entry point."""

from sinkax.cli import main

if __name__ == "__main__":
    raise SystemExit(main())
