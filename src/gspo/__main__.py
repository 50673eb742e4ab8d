"""`python -m gspo` is the `gspo` command."""

from gspo.cli import main

if __name__ == "__main__":
    raise SystemExit(main())
