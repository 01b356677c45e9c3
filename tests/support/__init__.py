"""Helpers the tests share: real processes and servers, engines' common checks, a toy engine, the embedded model."""
