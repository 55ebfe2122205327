"""`python -m app serve ...` is the same as `ft serve ...`."""

from app.cli import main

raise SystemExit(main())
