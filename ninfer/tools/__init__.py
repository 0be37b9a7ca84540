"""Offline tools: `ninfer journal` (read a journal)."""
