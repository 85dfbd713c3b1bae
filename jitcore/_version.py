"""The one version of both packages (jitcore and replay ship as one distribution, jitreplay):
pyproject.toml reads it for the distribution's metadata, and each package's ``__version__`` is it."""

__version__ = "0.1.0"
