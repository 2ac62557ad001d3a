"""``python -m services.room``: serve RoomService until SIGTERM."""

from quayutec.config import ROOM
from quayutec.server import run_service
from services.room.server import main

run_service(main, ROOM)
