"""Inference engines: the async protocol, the embedded CPU engine and the SGLang client."""
