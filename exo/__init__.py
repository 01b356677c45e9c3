from exo.helpers import DEBUG, DEBUG_DISCOVERY, VERSION

__all__ = ["DEBUG", "DEBUG_DISCOVERY", "VERSION"]
