"""Drivers for real agent harnesses (OpenCode), used by the demo and the end-to-end tests."""
