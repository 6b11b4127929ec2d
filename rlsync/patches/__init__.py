"""Version-guarded patches for frameworks that have no hook point."""


def minor_supported(version: str, supported: tuple[str, ...]) -> bool:
    """Whether ``version``'s major.minor (``"1.16.0"`` -> ``"1.16"``) is one of ``supported``."""
    return ".".join(version.split(".")[:2]) in supported
