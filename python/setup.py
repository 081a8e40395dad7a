"""The offload wheel: the Python package with liboffload_c.so and cpu_optimizer_server inside it
(offload/lib/, offload/bin/). Built by scripts/build-wheel from a staging copy that holds them;
run from python/ itself it makes a package without them, which finds a build tree instead."""

import re
from pathlib import Path

from setuptools import setup

HERE = Path(__file__).resolve().parent
VERSION = re.search(r'^__version__ = "([^"]+)"', (HERE / "offload" / "__init__.py").read_text(),
                    re.M).group(1)

setup(
    name="offload",
    version=VERSION,
    description="ZeRO-Offload's optimizer servers behind torch.optim: offload.torch.AdamW",
    packages=["offload"],
    package_data={"offload": ["lib/*.so", "bin/*"]},
    python_requires=">=3.9",
    # torch is the user's (Debian's python3-torch through --system-site-packages, or PyPI's):
    # offload.torch imports it, plain `import offload` does not.
    install_requires=[],
    entry_points={"console_scripts": []},
    zip_safe=False,
)
