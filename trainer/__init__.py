"""COPC trainer package."""
