"""``python -m services.room``: serve RoomService until SIGTERM."""

import sys

from quayutec.config import ROOM
from quayutec.server import run_service
from quayutec.settings import service_arguments
from services.room.server import main

service_arguments(ROOM, sys.argv[1:])  # --help prints the settings; nothing else is taken
run_service(main, ROOM)
