"""fusion-advisor's version: a module of its own so that stages can name it (report footers, meta.json)
without importing the package's façade, which sits above them."""

__version__ = "0.1.0"
