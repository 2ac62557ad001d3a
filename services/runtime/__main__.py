from quayutec.config import RUNTIME
from quayutec.server import run_service
from services.runtime.server import main

run_service(main, RUNTIME)
