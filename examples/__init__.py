"""Runnable examples of pallas_attn in models (`python -m examples.<name>` from the repo root)."""
