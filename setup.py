"""Installs the ``template`` package; requirements come from requirements.txt, the version from template/__init__.py."""

import re
from pathlib import Path

from setuptools import find_packages, setup

here = Path(__file__).parent
version = re.search(r'^__version__ = "([^"]+)"', (here / "template" / "__init__.py").read_text(), re.M).group(1)
requirements = [
    line.strip()
    for line in (here / "requirements.txt").read_text().splitlines()
    if line.strip() and not line.startswith("#")
]

setup(
    name="diloco-subnet",
    version=version,
    description="A Bittensor subnet where miners train one language model together with DiLoCo over hivemind",
    long_description=(here / "README.md").read_text(),
    long_description_content_type="text/markdown",
    packages=find_packages(include=["template", "template.*"]),
    package_data={"template.base": ["dashboard.html"]},
    python_requires=">=3.10,<3.13",
    install_requires=requirements,
    extras_require={
        "test": ["pytest>=8", "pytest-timeout>=2.3", "hypothesis>=6", "ruff>=0.5", "selenium>=4.20"],
    },
)
