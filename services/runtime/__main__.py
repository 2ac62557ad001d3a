"""``python -m services.runtime``: serve the Runtime until SIGTERM."""

import sys

from quayutec.config import RUNTIME
from quayutec.server import run_service
from quayutec.settings import service_arguments
from services.runtime.server import main

service_arguments(RUNTIME, sys.argv[1:])  # --help prints the settings; nothing else is taken
run_service(main, RUNTIME)
