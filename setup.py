"""Build script: compiles the Cython kernels in dualmode/_core.

Set DUALMODE_DEBUG_CYTHON=1 to build with bounds checks, wraparound and
initialisation checks turned back on (slower, for debugging kernels).
"""
import glob
import os

import numpy as np
from Cython.Build import cythonize
from setuptools import Extension, setup

DEBUG = os.environ.get("DUALMODE_DEBUG_CYTHON", "0") not in ("", "0")

directives = {
    "language_level": 3,
    "boundscheck": DEBUG,
    "wraparound": DEBUG,
    "initializedcheck": DEBUG,
    "cdivision": not DEBUG,
    "embedsignature": True,
}

# every dualmode/_core/*.pyx is one extension module of the same name
extensions = [
    Extension(
        f"dualmode._core.{os.path.splitext(os.path.basename(path))[0]}",
        [path],
        include_dirs=[np.get_include()],
        define_macros=[("NPY_NO_DEPRECATED_API", "NPY_1_7_API_VERSION")],
        extra_compile_args=["-O3"] if not DEBUG else ["-O0", "-g"],
    )
    for path in sorted(glob.glob("dualmode/_core/*.pyx"))
]

setup(ext_modules=cythonize(extensions, compiler_directives=directives))
