"""Tenancy: who acts for whom, and what they may see and do (actors.py)."""
