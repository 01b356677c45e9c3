"""OpenAI's Responses API (POST /v1/responses), stateless: see docs/api-dialects.md."""
