"""COPC environments package."""
