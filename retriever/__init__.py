"""COPC retriever package."""
