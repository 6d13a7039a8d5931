"""The `jlora` command line."""
