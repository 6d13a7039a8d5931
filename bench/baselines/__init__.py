"""The systems jlora is measured against, each started as its users start it."""
