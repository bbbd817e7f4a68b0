"""`python -m conveyor ...` runs the `conveyor` command line."""
try:
    from .cli import main
except KeyboardInterrupt:  # Ctrl-C while the command line itself loads
    raise SystemExit(130)

raise SystemExit(main())
