"""The package's version, in a module that imports nothing: the package face
(``engine.__version__``) and the checkpoints (their ``meta.json``) read it from here.
``pyproject.toml`` states the same version for the distribution."""

__version__ = "0.1.0"
