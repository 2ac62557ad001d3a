"""``python -m services.claims``: run the Claims service until SIGTERM."""

from quayutec.config import CLAIMS
from quayutec.server import run_service
from services.claims.server import main

run_service(main, CLAIMS)
