"""Ollama's API (/api/chat, /api/generate, /api/tags, /api/show, /api/ps, /api/version): see docs/api-dialects.md."""
