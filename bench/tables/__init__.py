"""Markdown tables of runners' JSON that bench/report.py dispatches to (one module per runner)."""
