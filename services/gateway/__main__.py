"""``python -m services.gateway``: serve the Gateway until SIGTERM."""

import sys

from quayutec.config import GATEWAY
from quayutec.server import run_service
from quayutec.settings import service_arguments
from services.gateway.server import main

service_arguments(GATEWAY, sys.argv[1:])  # --help prints the settings; nothing else is taken
run_service(main, GATEWAY)
