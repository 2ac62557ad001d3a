"""``python -m services.console``: serve the room console (HTTP) until SIGTERM or Ctrl-C."""

import argparse
import sys

from quayutec.settings import for_service
from services.console.app import main

lines = [f"  {s.name}  (default {s.default_text})\n      {s.meaning}" for s in for_service("console")]
argparse.ArgumentParser(
    prog="python -m services.console",
    description="Serve the room console, a web page over the Gateway, until SIGTERM or Ctrl-C. It takes no "
    "arguments: every setting is an environment variable, read once at start-up.",
    epilog="settings:\n" + "\n".join(lines),
    formatter_class=argparse.RawDescriptionHelpFormatter,
).parse_args(sys.argv[1:])
sys.exit(main())
