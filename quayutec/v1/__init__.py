"""Generated from protos/quayutec/v1 by scripts/gen_protos.py; do not edit."""
