"""``python -m services.gateway``: serve the Gateway until SIGTERM."""

from quayutec.config import GATEWAY
from quayutec.server import run_service
from services.gateway.server import main

run_service(main, GATEWAY)
