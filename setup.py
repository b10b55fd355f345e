"""The packages of nixl-twisted; its metadata is in pyproject.toml.

``twisted.plugins`` is Twisted's package, with no ``__init__.py`` of ours:
listed by hand, so that the wheel carries ``twisted/plugins/nixlproxy.py``
(how ``twistd`` finds ``nixlproxy``) and nothing else of that folder.
"""

from setuptools import find_packages, setup

setup(
    packages=[*find_packages(include=["nixl_twisted", "nixl_twisted.*"]), "twisted.plugins"],
    package_data={"nixl_twisted": ["py.typed"], "nixl_twisted.web": ["static/*"]},
    # The sdist's docs and tests (MANIFEST.in) stay out of the wheel.
    include_package_data=False,
)
