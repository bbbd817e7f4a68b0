"""`python -m conveyor ...` runs the `conveyor` command line."""
import sys

try:
    from .cli import main
except KeyboardInterrupt:  # Ctrl-C while the command line itself loads: ended by SIGINT, quietly
    sys.excepthook = lambda *exc_info: None
    raise

raise SystemExit(main())
