"""`python -m conveyor ...` runs the `conveyor` command line."""
from .cli import main

raise SystemExit(main())
