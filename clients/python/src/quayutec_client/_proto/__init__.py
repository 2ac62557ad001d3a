"""The Gateway API's messages, generated from protos/quayutec/v1 by scripts/gen_protos.py; do not edit."""
