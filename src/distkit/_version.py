"""distkit's version, a leaf: modules inside distkit read it here, never from the package root."""

__version__ = "0.1.0"
