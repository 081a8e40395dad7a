"""The offload wheel: the Python package with liboffload_c.so and cpu_optimizer_server inside it
(offload/lib/, offload/bin/). Built by scripts/build-wheel from a staging copy that holds them
(and UCX's cma module, offload/lib/ucx/, with offload/etc/ucx.conf), then repaired by auditwheel,
which vendors the C++ libraries they need into offload/lib/; run from python/ itself it makes a
package without them, which finds a build tree instead."""

import re
from pathlib import Path

from setuptools import Distribution, find_packages, setup

try:  # setuptools >= 70.1 has the command itself; older ones (Debian 12's 66) take wheel's
    from setuptools.command.bdist_wheel import bdist_wheel
except ImportError:
    from wheel.bdist_wheel import bdist_wheel

HERE = Path(__file__).resolve().parent
VERSION = re.search(r'^__version__ = "([^"]+)"', (HERE / "offload" / "__init__.py").read_text(),
                    re.M).group(1)


class NativeDistribution(Distribution):
    """The package holds native code: it installs as platlib (Root-Is-Purelib false), which
    auditwheel requires of a wheel it repairs."""

    def has_ext_modules(self):
        return True


class PlatformWheel(bdist_wheel):
    """py3-none-<platform>: native code, but no CPython extension (ctypes loads the library), so
    any Python 3 on the platform takes it, not only the CPython that built the wheel."""

    def get_tag(self):
        return "py3", "none", super().get_tag()[2]


setup(
    name="offload",
    version=VERSION,
    description="ZeRO-Offload's optimizer servers behind torch.optim: offload.torch.AdamW",
    packages=find_packages(where=str(HERE), include=["offload", "offload.*"]),
    package_data={"offload": ["lib/*.so", "lib/ucx/*", "bin/*", "etc/*"]},
    python_requires=">=3.9",
    # torch is the user's (PyPI's CPU or CUDA build, or Debian's python3-torch through
    # --system-site-packages): offload.torch imports it, plain `import offload` does not, and a
    # `torch` requirement would make pip fetch PyPI's default (CUDA) build into a venv that has
    # no torch yet. (accelerate, in the hf extra, requires torch: install torch first.)
    install_requires=[],
    extras_require={
        # Hugging Face Trainer and accelerate (offload.hf): `pip install 'offload[hf]'`.
        # transformers 4.47 is the first with Trainer(optimizer_cls_and_kwargs=...).
        "hf": ["transformers>=4.47", "accelerate>=0.26"],
    },
    distclass=NativeDistribution,
    cmdclass={"bdist_wheel": PlatformWheel},
    entry_points={"console_scripts": []},
    zip_safe=False,
)
