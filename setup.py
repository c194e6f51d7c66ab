"""The one thing pyproject.toml cannot say: the rooms' folders install under one import package.

The repository keeps its rooms at the top (kvstore/, sdk/, server/, connectors/, engine/ and the
simulator, fleet_sim/); an installed kvstore puts only `kvstore` into site-packages, each
room a subpackage of it (`kvstore.sdk`, `kvstore.server`, ...). Everything else is in pyproject.toml.
"""

from setuptools import find_packages, setup

PACKAGE_DIR = {
    "kvstore": "kvstore",
    "kvstore.sdk": "sdk",
    "kvstore.server": "server",
    "kvstore.connectors": "connectors",
    "kvstore.engine": "engine",
    "kvstore.fleet_sim": "fleet_sim",
}

packages = []
for package, folder in PACKAGE_DIR.items():
    packages += [package] + [f"{package}.{sub}" for sub in find_packages(folder)]

setup(packages=packages, package_dir=PACKAGE_DIR)
