"""A decentralized DiLoCo training subnet (Subnet 38 style) on Bittensor.

``__version__`` is the package version; ``spec_version`` is the integer that validators pass as the
``version_key`` of ``SetWeights`` so that the chain can refuse weights from outdated validators.
"""

__version__ = "0.1.0"


def _spec_version_from(version: str) -> int:
    """``"MAJOR.MINOR.PATCH"`` → ``MAJOR*1000_000 + MINOR*1000 + PATCH`` (the subnet-template convention)."""
    major, minor, patch = (int(part) for part in version.split("."))
    return major * 1_000_000 + minor * 1_000 + patch


spec_version = _spec_version_from(__version__)
