"""``python -m services.claims``: run the Claims service until SIGTERM."""

import sys

from quayutec.config import CLAIMS
from quayutec.server import run_service
from quayutec.settings import service_arguments
from services.claims.server import main

service_arguments(CLAIMS, sys.argv[1:])  # --help prints the settings; nothing else is taken
run_service(main, CLAIMS)
