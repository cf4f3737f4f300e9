"""The test suite. A package, so that test modules import their shared code as ``tests.helpers``."""
