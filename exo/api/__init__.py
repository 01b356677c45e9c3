from exo.api.chatgpt_api import ChatGPTAPI

__all__ = ["ChatGPTAPI"]
